"""The routers under test in the live benchmark, as child processes on loopback.

- a skymesh balancer (``skymesh balancer --config ... --region ...``) with policy NAME
  (any registry name): the central single-balancer setup, one region owning every replica;
- the real peer routers ``sglang-router`` and ``vllm-router`` (optional extra
  ``[peers]``: ``.venv/bin/pip install -e '.[peers]'``) with their cache-aware policy, bound to
  127.0.0.1 with ``HF_ENDPOINT`` pointed at an unused loopback port so nothing leaves the
  machine. Not installed → ``None`` and the caller skips that system with a message.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from skymesh.bench.sim_config import BENCH_QUEUE_BOUND
from skymesh.runtime.procs import Child, free_port, skymesh_cmd

PEERS = ("sglang-router", "vllm-router")
INSTALL_HINT = ".venv/bin/pip install -e '.[peers]'"


def _offline_env() -> dict[str, str]:
    port = free_port()
    return {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"}


def peer_available(system: str) -> bool:
    if system == "sglang-router":
        return importlib.util.find_spec("sglang_router") is not None
    if system == "vllm-router":
        return shutil.which("vllm-router") is not None or (Path(sys.executable).parent / "vllm-router").exists()
    return False


def peer_child(system: str, urls: Sequence[str], port: int, log_dir: Path, policy: str = "cache_aware") -> Child | None:
    """A peer router in front of ``urls``, or None when it is not installed."""
    if not peer_available(system):
        return None
    if system == "sglang-router":
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", policy, "--worker-urls", *urls]
    else:
        cmd = [_vllm_router_exe(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--worker-urls", *urls]
    return Child(system, cmd, log_dir, env=_offline_env())


def _vllm_router_exe() -> str:
    return shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")


def vllm_router_pd_child(prefill_urls: Sequence[str], decode_urls: Sequence[str], port: int, log_dir: Path,
                         policy: str = "cache_aware", name: str = "vllm-router-pd") -> Child | None:
    """vllm-router in its vLLM P/D mode (``--vllm-pd-disaggregation``, NIXL's pull protocol
    by default) over fixed prefill and decode pools: every request is split, its prefill
    worker and its decode worker each picked by ``policy``. Its Prometheus listener (on by
    default, port 29000) gets a picked loopback port so that two runs never collide.
    None when it is not installed."""
    if not peer_available("vllm-router"):
        return None
    cmd = [_vllm_router_exe(), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
           "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    for u in prefill_urls:
        cmd += ["--prefill", u]
    for u in decode_urls:
        cmd += ["--decode", u]
    return Child(name, cmd, log_dir, env=_offline_env())


def balancer_config(policy: str, urls: Sequence[str], port: int, slo_s: float, region: str = "bench-1",
                    chunk_tokens: int = 512, slo_classes: Mapping[str, Any] | None = None,
                    early_rejection: bool = True, queue: Mapping[str, Any] | None = None) -> dict[str, object]:
    """A one-region mesh config: one balancer owning every replica, no offload. Port 0
    (bind any, report it) is the balancer's --http-port, not the config's (which wants 1-65535).
    ``slo_classes``: the classes the load generator's requests name (as the mesh config
    writes them); ``queue``: the config's ``queue:`` section (discipline and its bounds)."""
    classes: dict[str, object] = {}
    if slo_classes:
        classes = {"slo_classes": dict(slo_classes), "slo_early_rejection": early_rejection}
    return {
        **classes,
        "queue": dict(queue or {}),
        "model": "skymesh-sim",
        "regions": [{"name": region, "source_networks": ["127.1.0.0/16"],
                     "balancer": {"listen": f"127.0.0.1:{port or free_port()}", "grpc_listen": f"127.0.0.1:{free_port()}"},
                     "replicas": [{"id": f"r{i}", "url": u} for i, u in enumerate(urls)]}],
        "controller": {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}"},
        "dns": {"name": "llm.bench.local", "listen": f"127.0.0.1:{free_port(span=2)}"},
        "policy": {"name": policy, "ttft_slo_s": slo_s, "queue_bound": BENCH_QUEUE_BOUND, "chunk_tokens": chunk_tokens},
        "offload": {"enabled": False},
    }


def balancer_child(policy: str, urls: Sequence[str], port: int, log_dir: Path, slo_s: float,
                   slo_classes: Mapping[str, Any] | None = None, early_rejection: bool = True,
                   queue: Mapping[str, Any] | None = None) -> Child:
    config = balancer_config(policy, urls, port, slo_s, slo_classes=slo_classes, early_rejection=early_rejection,
                             queue=queue)
    return balancer_config_child(config, f"balancer-{policy}", port, log_dir)


def balancer_config_child(config: Mapping[str, Any], name: str, port: int, log_dir: Path,
                          region: str = "bench-1") -> Child:
    """A skymesh balancer child for region ``region`` of ``config`` (as
    :func:`balancer_config` makes it, perhaps amended), its config written to
    ``log_dir/NAME.yaml``; port 0: it binds any and reports it."""
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(config)))
    return Child(name, skymesh_cmd("balancer", "--config", str(path), "--region", region, "--http-port", str(port),
                                   "--no-controller", "--no-peers", "--log-level", "WARNING"),
                 log_dir)


def router_child(system: str, urls: Sequence[str], port: int, log_dir: Path, slo_s: float,
                 slo_classes: Mapping[str, Any] | None = None, early_rejection: bool = True,
                 queue: Mapping[str, Any] | None = None) -> Child | None:
    """The router under test. A peer router knows no SLO classes: the header its requests
    carry passes through unread, and the classes are judged at the client alike."""
    if system in PEERS:
        return peer_child(system, urls, port, log_dir)
    return balancer_child(system, urls, port, log_dir, slo_s, slo_classes, early_rejection, queue)
