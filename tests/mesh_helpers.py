"""Shared helpers for integration tests: free ports, subprocesses stopped by PID,
configs built from the embedded default."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
SKYMESH = [sys.executable, "-m", "skymesh.cli"]


_issued: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now and not handed out before in this test session (the kernel
    happily returns the same ephemeral port twice in a row)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _issued and port + 1 not in _issued:
            _issued.add(port)
            return port


class Proc:
    """A child process in its own process group; stopped by PID, never by name."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )

    @property
    def pid(self) -> int:
        return self.p.pid

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)

    def stop(self, grace: float = 5.0) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


async def wait_http_ok(url: str, within_s: float = 30.0, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.p.poll() is not None:
                raise RuntimeError(f"{proc.args} exited early:\n{proc.tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {within_s}s" + (f":\n{proc.tail()}" if proc else ""))


def start_replica_sim(tmp: Path, port: int, profile: str = "tiny-test", time_scale: float = 1.0,
                      extra: list[str] | None = None) -> Proc:
    args = [*SKYMESH, "replica-sim", "--host", "127.0.0.1", "--port", str(port), "--profile", profile,
            "--time-scale", str(time_scale), *(extra or [])]
    return Proc(args, tmp / f"replica-{port}.log")


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
        "dns": {"name": "llm.skymesh.local", "listen": f"127.0.0.1:{free_port()}"},
        "policy": {"name": "dualmap", "ttft_slo_s": 2.0, "probe_interval_s": 0.05, **policy},
        "offload": {"enabled": False},
    }


def local_config_free_ports(time_scale: float = 1.0) -> dict[str, Any]:
    """The embedded local.yaml with every port replaced by a free one (and the advertise
    addresses kept on their per-region loopback IPs)."""
    import yaml

    data = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    for r in data["regions"]:
        b = r["balancer"]
        b["listen"] = f"127.0.0.1:{free_port()}"
        b["grpc_listen"] = f"127.0.0.1:{free_port()}"
        adv_host = b["advertise"].rsplit(":", 1)[0]
        b["advertise"] = f"{adv_host}:{free_port(adv_host)}"
        gadv_host = b["grpc_advertise"].rsplit(":", 1)[0]
        b["grpc_advertise"] = f"{gadv_host}:{free_port(gadv_host)}"
        for rep in r["replicas"]:
            rep["sim"]["port"] = free_port()
            rep["sim"]["time_scale"] = time_scale
    data["controller"]["listen"] = f"127.0.0.1:{free_port()}"
    data["controller"]["http_listen"] = f"127.0.0.1:{free_port()}"
    dns_port = free_port()
    while True:  # the control endpoint is dns port + 1: both must be free
        try:
            with socket.socket() as t:
                t.bind(("127.0.0.1", dns_port + 1))
            _issued.add(dns_port + 1)
            break
        except OSError:
            dns_port = free_port()
    data["dns"]["listen"] = f"127.0.0.1:{dns_port}"
    return data
