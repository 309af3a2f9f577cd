"""The local 3-region mesh under the edge attacks of "Edges that hold", measured from
outside as an attacker and an operator would see them. Prints one JSON line.

* ``bombs``: us-east-1's ``/health`` latency (a request every 50 ms) idle, then while
  ten 1 MB gzip bodies inflating to 1 GiB each arrive in 20 s (to ``/v1/completions``,
  the API open as in the default mesh, and to a path with no route); and whether the
  controller ever marked us-east-1 dead meanwhile (its status polled every 0.5 s).
* ``flood``: us-east-1's balancer RSS before and while ``--flood`` connections each send
  an endless request head (header fields of 4,000 bytes, 1 MB in all per connection;
  a connection closed by the server is opened again, up to the count, for 20 s).
* ``slow``: how long the controller's HTTP API and the DNS control API keep a connection
  that sends one byte of a request head and then nothing (up to 120 s).
* ``oversized``: prompts that cannot fit the model ("No request of death"): a 4 MB and a
  1 MB prompt, a 100 KB one and a chat of 50,000 messages, one after another, to
  us-east-1's balancer without credentials, while a trickle of ordinary requests (one
  every 100 ms) goes to the same balancer; for each: its answer, how long it took, the
  balancer's CPU seconds meanwhile; then the trickle's answers and which region served
  them, and how many us-east-1 replicas were ejected.

    PYTHONPATH=. .venv/bin/python -m benchmarks.edge_attacks [--flood 600] [--only oversized]

The mesh is the default one (configs/local.yaml, the shipped tokenizer included) on free
ports.

Bounded: every load loop stops by count and by time; the mesh is stopped on any exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.operations.up import Mesh  # noqa: E402
from skymesh.security.admin_auth import admin_headers  # noqa: E402
from tests.mesh_helpers import local_config_free_ports  # noqa: E402

GIB = 1024 * 1024 * 1024


def gzip_bomb(inflated_bytes: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1024 * 1024)
    return b"".join([*(packer.compress(block) for _ in range(inflated_bytes // len(block))), packer.flush()])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered) * 1000, 2), "p99_ms": round(p99 * 1000, 2),
            "max_ms": round(ordered[-1] * 1000, 2)}


async def health_probe(session: aiohttp.ClientSession, url: str, seconds: float) -> list[float]:
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        async with session.get(url) as r:
            await r.read()
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.05)
    return latencies


async def send_raw(port: int, head: bytes, body: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        line = await reader.readline()
        return int(line.split()[1]) if line else 0
    except (ConnectionError, IndexError, ValueError):
        return 0
    finally:
        writer.close()


async def bombs(port: int, controller_url: str, admin: dict[str, str]) -> dict[str, Any]:
    bomb = gzip_bomb(GIB)
    async with aiohttp.ClientSession() as session:
        idle = await health_probe(session, f"http://127.0.0.1:{port}/health", 10.0)
        dead_seen: list[float] = []
        statuses: list[int] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                async with session.get(f"{controller_url}/v1/status", headers=admin) as r:
                    status = await r.json()
                for region in status["regions"]:
                    if region["region"] == "us-east-1" and not region["balancer_alive"]:
                        dead_seen.append(time.monotonic())
                await asyncio.sleep(0.5)

        async def attack() -> None:
            for i in range(10):
                path = "/v1/completions" if i % 2 == 0 else "/nope"
                head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        f"Content-Encoding: gzip\r\nContent-Length: {len(bomb)}\r\n\r\n").encode()
                statuses.append(await send_raw(port, head, bomb))
                await asyncio.sleep(2.0)

        watcher = asyncio.create_task(watch())
        attack_task = asyncio.create_task(attack())
        under = await health_probe(session, f"http://127.0.0.1:{port}/health", 20.0)
        await attack_task
        stop.set()
        await watcher
    return {"bomb_bytes": len(bomb), "inflated_bytes": GIB, "answers": statuses,
            "health_idle": quantiles(idle), "health_under_bombs": quantiles(under),
            "us_east_1_marked_dead": bool(dead_seen)}


async def flood(pid: int, port: int, connections: int, seconds: float = 20.0) -> dict[str, Any]:
    before = rss_bytes(pid)
    peak = before
    end = time.monotonic() + seconds
    opened = 0
    field = b"X-Pad: " + b"a" * 3991 + b"\r\n"  # 4,000 bytes

    async def one() -> None:
        nonlocal opened
        while time.monotonic() < end and opened < connections * 20:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            opened += 1
            try:
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                for _ in range(256):  # 1 MB of head, never ended
                    writer.write(field)
                    await writer.drain()
                    if reader.at_eof() or time.monotonic() >= end:
                        break
                await asyncio.wait_for(reader.read(64), timeout=max(0.1, end - time.monotonic()))
            except (ConnectionError, TimeoutError):
                pass  # closed by the server (431) while still sending, or the run's end
            finally:
                writer.close()

    async def sample() -> None:
        nonlocal peak
        while time.monotonic() < end:
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(0.2)

    await asyncio.gather(sample(), *(one() for _ in range(connections)))
    return {"connections": connections, "rss_before_mb": round(before / 2**20, 1),
            "rss_peak_mb": round(peak / 2**20, 1), "connections_opened": opened}


async def slow(port: int, limit_s: float = 120.0) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    try:
        writer.write(b"G")
        await asyncio.wait_for(reader.read(), timeout=limit_s)
    except TimeoutError:
        pass
    finally:
        writer.close()
    return round(time.monotonic() - start, 2)


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time (/proc/PID/stat, clock ticks)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


OVERSIZED = (
    ("prompt_4mb", "/v1/completions", {"prompt": "w " * 1_950_000, "max_tokens": 16}),
    ("prompt_1mb", "/v1/completions", {"prompt": "w " * 500_000, "max_tokens": 16}),
    ("prompt_100kb", "/v1/completions", {"prompt": "w " * 50_000, "max_tokens": 16}),
    ("chat_50000_messages", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hello"}] * 50_000, "max_tokens": 16}),
)


async def oversized(pid: int, port: int, model: str, metrics_headers: dict[str, str]) -> dict[str, Any]:
    base = f"http://127.0.0.1:{port}"
    trickle: list[tuple[int, str]] = []
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def ordinary() -> None:
            i = 0
            while not stop.is_set() and i < 2000:
                try:
                    async with session.post(base + "/v1/completions", json={
                            "model": model, "prompt": f"an ordinary request {i} " * 10, "max_tokens": 8}) as r:
                        await r.read()
                        trickle.append((r.status, r.headers.get("X-Skymesh-Path", "")))
                except (aiohttp.ClientError, TimeoutError):
                    trickle.append((0, ""))
                i += 1
                await asyncio.sleep(0.1)

        task = asyncio.create_task(ordinary())
        await asyncio.sleep(2.0)
        attacks: dict[str, Any] = {}
        for name, path, body in OVERSIZED:
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            try:
                async with session.post(base + path, json={"model": model, **body}) as r:
                    answer = await r.json(content_type=None)
                    status = r.status
            except (aiohttp.ClientError, TimeoutError) as e:
                status, answer = 0, {"error": {"message": type(e).__name__}}
            attacks[name] = {"status": status, "seconds": round(time.monotonic() - t0, 2),
                             "balancer_cpu_s": round(cpu_seconds(pid) - cpu0, 2),
                             "message": str((answer.get("error") or {}).get("message", ""))[:140]}
            await asyncio.sleep(1.0)
        await asyncio.sleep(3.0)
        stop.set()
        await task
        async with session.get(base + "/metrics", headers=metrics_headers) as r:
            page = await r.text()
    ejected = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                  if line.startswith("skymesh_replicas_ejected{"))
    paths: dict[str, int] = {}
    for status, path in trickle:
        key = f"{status} {path}".strip()
        paths[key] = paths.get(key, 0) + 1
    return {"attacks": attacks, "trickle": paths, "us_east_1_replicas_ejected_at_end": ejected}


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood", type=int, default=600, help="flooding connections")
    ap.add_argument("--only", choices=("bombs", "flood", "slow", "oversized"), action="append")
    args = ap.parse_args(argv)
    only = set(args.only or ("bombs", "flood", "slow", "oversized"))
    with tempfile.TemporaryDirectory() as state:
        data = local_config_free_ports(tokenizer=True)
        config = Path(state) / "mesh.yaml"
        config.write_text(yaml.safe_dump(data))
        mesh = Mesh(config, Path(state) / "state")
        await mesh.start()
        try:
            east = mesh.cfg.regions[0]
            port = east.balancer.listen.port
            proc = mesh.balancers[east.name].proc
            assert proc is not None
            pid = proc.pid
            c = mesh.cfg.controller.http_listen
            out: dict[str, Any] = {}
            if "bombs" in only:
                out["bombs"] = await bombs(port, f"http://{c.host}:{c.port}", admin_headers(mesh.admin_token))
            if "flood" in only:
                out["flood"] = await flood(pid, port, args.flood)
            if "slow" in only:
                dns_listen = mesh.cfg.dns.listen
                assert dns_listen is not None
                out["slow_closed_after_s"] = {"controller": await slow(c.port),
                                              "dns_control": await slow(dns_listen.port + 1)}
            if "oversized" in only:
                out["oversized"] = await oversized(pid, port, mesh.cfg.model, admin_headers(mesh.admin_token))
            print(json.dumps(out), flush=True)
        finally:
            await mesh.stop()


if __name__ == "__main__":
    asyncio.run(main())
