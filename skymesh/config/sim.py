"""A replica's ``sim:`` section: the vLLM stand-in ``skymesh up`` starts in place of a
real server (its hardware profile, port, and the KV events it publishes). Only the schema;
the stand-in itself is :mod:`skymesh.replica_sim`, which production code never imports."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, Strict, ValidationInfo, field_validator, model_validator

from skymesh.config.base import ConfigError, ConfigModel, FilePath, Float, Int, Port, Text
from skymesh.hardware import PROFILES


class SimKvEvents(ConfigModel):
    """The stand-in publishes vLLM 0.32's KV events (``replica-sim --kv-events-config``):
    its PUB socket on ``port`` and its replay ROUTER socket on ``replay_port`` of
    ``sim.host`` (started with vLLM's ``"endpoint": "tcp://*:PORT"``, which the stand-in
    binds on its ``--host``)."""

    port: Port
    replay_port: Port | None = None
    topic: Annotated[str, Strict()] = ""
    # batches the replay socket keeps
    buffer_steps: Annotated[Int, Field(ge=1)] = 10_000

    def vllm_json(self) -> str:
        """The ``--kv-events-config`` the stand-in is started with."""
        replay = None if self.replay_port is None else f"tcp://*:{self.replay_port}"
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.port}",
                           "replay_endpoint": replay, "topic": self.topic, "buffer_steps": self.buffer_steps},
                          separators=(",", ":"))


class SimKvTransfer(ConfigModel):
    """The stand-in plays vLLM 0.32's NixlConnector in pull mode (role kv_both): a prefill
    leg holds its KV under a lease and answers NIXL's ``kv_transfer_params``; a decode leg
    pulls them from the prefill replica's side channel (``replica-sim --kv-transfer-port``)."""

    # the "NIXL side channel" (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT): P's remote_port
    port: Port
    # None: a stable id derived from the stand-in's host:port
    engine_id: Text | None = None
    # vLLM's kv_connector_extra_config.kv_lease_duration
    lease_s: Annotated[Float, Field(gt=0.0, le=86_400.0)] = 30.0
    # the modelled KV pull: link bandwidth and latency
    bandwidth_gbps: Annotated[Float, Field(gt=0.0)] = 100.0
    latency_ms: Annotated[Float, Field(ge=0.0)] = 0.5
    # vLLM's kv_load_failure_policy
    load_failure_policy: Literal["fail", "recompute"] = "fail"
    # hosts a decode leg may dial besides loopback IP literals
    peers: list[Text] = Field(default_factory=list)

    def cli_args(self) -> list[str]:
        """The ``replica-sim`` flags for this section."""
        args = ["--kv-transfer-port", str(self.port), "--kv-lease-s", str(self.lease_s),
                "--kv-bandwidth-gbps", str(self.bandwidth_gbps), "--kv-latency-ms", str(self.latency_ms),
                "--kv-load-failure-policy", self.load_failure_policy]
        if self.engine_id is not None:
            args += ["--kv-engine-id", self.engine_id]
        for peer in self.peers:
            args += ["--kv-peer", peer]
        return args


class SimReplica(ConfigModel):
    """A vLLM stand-in started by ``skymesh up`` on ``port``."""

    profile: Text
    port: Port
    time_scale: Annotated[Float, Field(ge=0.001, le=1000.0)] = 1.0
    host: Text = "127.0.0.1"
    # the model's local HF tokenizer.json: the stand-in's token ids (prefix caching, KV
    # events) and its generated text are then the tokenizer's; without it, whitespace
    # words (pkg:skymesh/assets/tokenizer/tokenizer.json: the default mesh's)
    tokenizer: FilePath | None = None
    # publish vLLM's KV events; the replica's kv_events (what the balancer subscribes to)
    # follow from it
    kv_events: SimKvEvents | None = None
    # vLLM's --enable-prompt-tokens-details: answers' usage reports the cached prompt
    # tokens, which the balancer compares with its policy's prediction
    enable_prompt_tokens_details: bool = False
    # prefill/decode disaggregation as vLLM's NIXL pull connector (off: no connector)
    kv_transfer: SimKvTransfer | None = None

    @model_validator(mode="after")
    def _distinct_ports(self) -> SimReplica:
        kv = self.kv_events
        if kv is not None:
            if kv.port == self.port:
                raise ConfigError("kv_events.port", f"port {kv.port} is the replica's HTTP port too")
            if kv.replay_port is not None and kv.replay_port in (self.port, kv.port):
                raise ConfigError("kv_events.replay_port", f"port {kv.replay_port} is taken by the replica already")
        kt = self.kv_transfer
        if kt is not None:
            taken = {self.port} | ({kv.port, kv.replay_port} if kv is not None else set())
            if kt.port in taken:
                raise ConfigError("kv_transfer.port", f"port {kt.port} is taken by the replica already")
        return self

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, profile: str, info: ValidationInfo) -> str:
        context = info.context or {}
        if "profiles" in context:
            profiles = set(context["profiles"])
        else:
            profiles = set(PROFILES)
        if profiles and profile not in profiles:
            raise ConfigError("", f"unknown profile {profile!r} (known: {', '.join(sorted(profiles))})")
        return profile
