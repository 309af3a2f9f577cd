"""The balancer's parts built from the mesh config: the region core (by the assembly the
simulator uses too), the prompt encoder, the upstream timeouts. Built at start; the
timeouts again on a reload."""

from __future__ import annotations

import os

from skymesh.assembly import per_output_token_s, region_assembly
from skymesh.balancer.proxy import UpstreamTimeouts
from skymesh.config import ConfigError, MeshConfig, ReplicaConfig
from skymesh.context_window import max_chars_per_token
from skymesh.prompt_encoder import PromptEncoder
from skymesh.routing.assembly import build_region_core as assemble_region_core
from skymesh.routing.region import RegionCore


def upstream_timeouts(cfg: MeshConfig, replicas: tuple[ReplicaConfig, ...]) -> UpstreamTimeouts:
    """The attempt timeouts from ``upstream:`` (the per-token bound's default from the
    replicas' hardware profile: :func:`skymesh.assembly.per_output_token_s`)."""
    up = cfg.upstream
    return UpstreamTimeouts(
        connect_s=up.connect_timeout_s,
        first_byte_s=up.first_byte_timeout_s,
        per_output_token_s=per_output_token_s(up, replicas),
        stream_idle_s=up.stream_idle_timeout_s,
        leg_multiple=up.leg_deadline_multiple,
        leg_floor_s=up.leg_deadline_floor_s,
    )


def uses_kv_events(cfg: MeshConfig) -> bool:
    """Whether the replicas' KV events can be matched with prompts: the balancer hashes
    token ids only with a tokenizer (byte chunks never equal a block of token ids)."""
    return cfg.tokenizer.path is not None and any(rep.kv_events for r in cfg.regions for rep in r.replicas)


def build_region_core(cfg: MeshConfig, region: str, policy_name: str) -> RegionCore:
    """The region core from the mesh config, by the builder the simulator uses too."""
    return assemble_region_core(region_assembly(cfg, region, policy_name, kv_events=uses_kv_events(cfg)))


def build_encoder(cfg: MeshConfig) -> PromptEncoder:
    """The prompt encoder of ``tokenizer:``; a file that cannot be read is a startup error
    naming its config key."""
    t = cfg.tokenizer
    for key, path in (("tokenizer.path", t.path), ("tokenizer.chat_template", t.chat_template)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(key, f"no such file: {path}")
    try:
        return PromptEncoder.from_files(cfg.policy.chunk_tokens, t.path, t.chat_template, t.bytes_per_token)
    except Exception as e:  # the tokenizers / jinja2 parse errors of a broken file
        raise ConfigError("tokenizer", f"cannot load the tokenizer or chat template: {e}") from None


def chars_per_token_bound(cfg: MeshConfig, encoder: PromptEncoder) -> int | None:
    """The longest vocabulary entry in characters (skymesh/context_window.py):
    ``tokenizer.max_chars_per_token``, else read off the tokenizer; None without either
    (no character check: the replica makes its own)."""
    if cfg.tokenizer.max_chars_per_token is not None:
        return cfg.tokenizer.max_chars_per_token
    return None if encoder.tokenizer is None else max_chars_per_token(encoder.tokenizer)
