"""Shared helpers for the tests against real vLLM (tests marked ``vllm``): replicas started
together and stopped together, a balancer in front of them that hashes vLLM's own token
blocks, and a completion through it.

The replicas are :class:`skymesh.testing.vllm_env.VllmReplica` (venv built by ``make
vllm-env``; :func:`replicas_or_skip` skips with the reason when it is missing)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skymesh.balancer.server import Balancer
from skymesh.config import parse_config
from skymesh.runtime.procs import free_port
from skymesh.testing import vllm_env
from skymesh.testing.vllm_env import BLOCK_SIZE, MODEL_NAME, ReplicaOptions, VllmReplica
from tests.mesh_helpers import one_region_config, report_figures


@dataclass
class Pair:
    """Real vLLM replicas by name (the balancer's replica ids) and the tiny model's folder."""

    replicas: dict[str, VllmReplica]
    model_dir: Path

    @property
    def urls(self) -> dict[str, str]:
        return {name: r.url for name, r in self.replicas.items()}


def replicas_or_skip(options: dict[str, ReplicaOptions]) -> Pair:
    """Replicas (not started) of the tiny model, one per name with its options; skips the
    test, saying why, when there is no vLLM venv."""
    reason = vllm_env.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    model_dir = vllm_env.make_model_dir()
    return Pair({name: VllmReplica(name, model_dir, o) for name, o in options.items()}, model_dir)


async def start_all(p: Pair, figures: str, within_s: float = 240.0) -> None:
    """Start every replica at once (each waits up to ``within_s`` for its ``/health``);
    when one fails, stop them all and raise its error. Reports the start times as
    ``figures``."""
    t0 = time.monotonic()
    results = await asyncio.gather(*(r.start(within_s) for r in p.replicas.values()), return_exceptions=True)
    failed = [e for e in results if isinstance(e, BaseException)]
    if failed:
        await stop_all(p)
        raise failed[0]
    report_figures(figures, replicas=len(p.replicas), all_healthy_s=time.monotonic() - t0,
                   **{f"{n}_s": r.start_seconds for n, r in p.replicas.items()})


async def stop_all(p: Pair) -> None:
    await asyncio.gather(*(r.stop() for r in p.replicas.values()))


@contextlib.asynccontextmanager
async def balancer(p: Pair, policy: str, kv_events: bool = False,
                   shape: Callable[[dict[str, Any]], None] | None = None,
                   **options: Any) -> AsyncIterator[tuple[Balancer, str]]:
    """An in-process balancer (port 0) over the replicas, token-true hashing in vLLM's
    blocks, once it sees every replica healthy; ``kv_events``: subscribed to the replicas'
    KV events; ``shape``: edits the config dict before it is parsed (roles, sections)."""
    cfg_dict = one_region_config(p.urls, free_port(), free_port(), name=policy, chunk_tokens=BLOCK_SIZE,
                                 probe_interval_s=0.1, **({"options": options} if options else {}))
    if kv_events:
        for rep_cfg in cfg_dict["regions"][0]["replicas"]:
            rep = p.replicas[rep_cfg["id"]]
            rep_cfg["kv_events"] = {"endpoint": rep.kv_endpoint, "replay_endpoint": rep.kv_replay_endpoint,
                                    "topic": rep.options.kv_topic}
    cfg_dict["model"] = MODEL_NAME
    cfg_dict["tokenizer"] = {"path": str(p.model_dir / "tokenizer.json"),
                             "chat_template": str(p.model_dir / "chat_template.jinja")}
    if shape is not None:
        shape(cfg_dict)
    b = Balancer(parse_config(cfg_dict), "us-east-1")
    await b.start(port=0)
    try:
        for _ in range(300):
            if sum(v.healthy for v in b.core.view.replicas.values()) == len(p.replicas):
                break
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError(f"the balancer never saw every vLLM replica healthy: {b.admin_status()}")
        yield b, f"http://127.0.0.1:{b.bound_port}"
    finally:
        await b.stop()


def words(tag: str, n: int) -> str:
    """A prompt of n distinct words (about 4-5 tokens each with the tiny tokenizer)."""
    return " ".join(f"{tag}{i}" for i in range(n))


async def complete(s: aiohttp.ClientSession, base: str, prompt: Any, max_tokens: int = 4,
                   **extra: Any) -> tuple[int, dict[str, str], Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    async with s.post(base + "/v1/completions", json=body) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)
