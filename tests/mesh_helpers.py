"""Shared helpers for integration tests: mesh configs built from the embedded default.

Processes and ports come from :mod:`skymesh.runtime.procs` (``Child``, ``free_port``,
``start_sim_replicas``), the same code ``skymesh up`` and the benchmarks use."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from skymesh.runtime.procs import free_port
from skymesh.security.admin_auth import admin_headers

ROOT = Path(__file__).resolve().parent.parent


def admin_auth() -> dict[str, str]:
    """The admin token header for the daemons tests start (the token is set in conftest)."""
    return admin_headers(os.environ.get("SKYMESH_ADMIN_TOKEN"))


def one_region_config(replica_urls: dict[str, str], balancer_port: int, grpc_port: int,
                      **policy: Any) -> dict[str, Any]:
    """A single-region mesh config dict around existing replica URLs."""
    return {
        "model": "skymesh-sim",
        "regions": [
            {
                "name": "us-east-1",
                "source_networks": ["127.1.0.0/16"],
                "balancer": {"listen": f"127.0.0.1:{balancer_port}", "grpc_listen": f"127.0.0.1:{grpc_port}"},
                "replicas": [{"id": rid, "url": url} for rid, url in replica_urls.items()],
            }
        ],
        "controller": {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}"},
        "dns": {"name": "llm.skymesh.local", "listen": f"127.0.0.1:{free_port(span=2)}"},
        "policy": {"name": "dualmap", "ttft_slo_s": 2.0, "probe_interval_s": 0.05, **policy},
        "offload": {"enabled": False},
    }


def local_config_free_ports(time_scale: float = 1.0, siblings: int = 0, tokenizer: bool = False) -> dict[str, Any]:
    """The embedded local.yaml with every port replaced by a free one (and the advertise
    addresses kept on their per-region loopback IPs); with ``siblings``, each region runs
    that many further balancers (a fleet behind its advertised addresses). Without
    ``tokenizer`` the shipped tokenizer is left out (balancer and stand-ins count
    whitespace words and bytes, which the mesh tests' prompts and timings are sized for)."""
    import yaml

    data = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    if not tokenizer:
        data.pop("tokenizer", None)
        for r in data["regions"]:
            for rep in r["replicas"]:
                rep["sim"].pop("tokenizer", None)
    for r in data["regions"]:
        b = r["balancer"]
        b["listen"] = f"127.0.0.1:{free_port()}"
        b["grpc_listen"] = f"127.0.0.1:{free_port()}"
        adv_host = b["advertise"].rsplit(":", 1)[0]
        b["advertise"] = f"{adv_host}:{free_port(adv_host)}"
        gadv_host = b["grpc_advertise"].rsplit(":", 1)[0]
        b["grpc_advertise"] = f"{gadv_host}:{free_port(gadv_host)}"
        b["peer_listen"] = f"127.0.0.1:{free_port()}"
        padv_host = b["peer_advertise"].rsplit(":", 1)[0]
        b["peer_advertise"] = f"{padv_host}:{free_port(padv_host)}"
        if siblings:
            b["siblings"] = [{"listen": f"127.0.0.1:{free_port()}", "grpc_listen": f"127.0.0.1:{free_port()}",
                              "peer_listen": f"127.0.0.1:{free_port()}"} for _ in range(siblings)]
        for rep in r["replicas"]:
            rep["sim"]["port"] = free_port()
            rep["sim"]["time_scale"] = time_scale
    data["controller"]["listen"] = f"127.0.0.1:{free_port()}"
    data["controller"]["http_listen"] = f"127.0.0.1:{free_port()}"
    # the DNS control endpoint is the DNS port + 1: both must be free
    data["dns"]["listen"] = f"127.0.0.1:{free_port(span=2)}"
    return data


def report_figures(name: str, **figures: Any) -> None:
    """Print a fault test's figures as one ``FIGURES {json}`` line (seen with ``pytest -s``;
    docs/reliability.md collects them with the command that made them)."""
    import json

    rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    print(f"\nFIGURES {json.dumps({'test': name, **rounded})}", flush=True)
