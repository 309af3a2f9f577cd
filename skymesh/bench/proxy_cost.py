"""`skymesh bench proxy`: balancer CPU per proxied request, on loopback.

In one run, against the same stand-in replicas (time scale tiny, so the replicas answer
at once): (1) requests straight to the replicas (the direct baseline: client latency),
(2) through a skymesh balancer (its process CPU per request, from /proc), (3) through
sglang-router (round_robin) when it is installed (`.venv/bin/pip install -e '.[peers]'`). The routers
run as their own processes; CPU is user+system time of that process tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from skymesh.bench.peers import INSTALL_HINT
from skymesh.runtime.procs import Child, free_port, skymesh_cmd, start_sim_replicas, wait_healthy


def cpu_seconds(pid: int) -> float:
    """user+system CPU of a process and its children (clock ticks from /proc)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        for child in Path(f"/proc/{pid}/task").iterdir():
            kids = (child / "children").read_text().split()
            pids.extend(int(k) for k in kids)
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


def _prompt(i: int, prompt_chars: int) -> str:
    """Request i's prompt: 50 distinct ones, padded to ``prompt_chars`` characters."""
    head = f"request {i % 50} hello world "
    if len(head) >= prompt_chars:
        return head
    return head + ("the quick brown fox jumps over the lazy dog " * (prompt_chars // 44 + 1))[: prompt_chars - len(head)]


async def _drive(url: str, n: int, concurrency: int, max_tokens: int, prompt_chars: int = 0) -> list[float]:
    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i: int) -> None:
            body = {"model": "skymesh-sim", "prompt": _prompt(i, prompt_chars), "max_tokens": max_tokens,
                    "stream": True}
            async with sem:
                t0 = time.perf_counter()
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200, r.status
                    await r.read()
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(i) for i in range(n)))
    return lat


async def _router_cost(router: Child, url: str, n: int, concurrency: int, max_tokens: int,
                       prompt_chars: int = 0) -> dict[str, float]:
    """CPU per request of a router process: warm up, drive n requests, subtract the
    router's idle CPU (probing, timers) over the same wall time."""
    await _drive(url, 200, concurrency, max_tokens, prompt_chars)
    assert router.pid is not None
    c0 = cpu_seconds(router.pid)
    t0 = time.perf_counter()
    lat = await _drive(url, n, concurrency, max_tokens, prompt_chars)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(router.pid) - c0
    c1 = cpu_seconds(router.pid)
    await asyncio.sleep(3)
    idle = (cpu_seconds(router.pid) - c1) / 3 * wall
    return {"cpu_us_per_request": round((cpu - idle) / n * 1e6, 1),
            "cpu_us_per_request_incl_idle": round(cpu / n * 1e6, 1),
            "p50_ms": round(statistics.median(lat) * 1000, 3)}


async def measure(n: int, replicas: int, concurrency: int, max_tokens: int, prompt_chars: int = 0,
                  tokenizer: str | None = None) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="skymesh-proxy-"))
    children: list[Child] = []
    results: dict[str, Any] = {"requests": n, "concurrency": concurrency, "replicas": replicas,
                               "max_tokens": max_tokens, "prompt_chars": prompt_chars, "tokenizer": tokenizer}
    try:
        reps, urls = await start_sim_replicas(replicas, "tiny-test", 0.001, tmp)
        children.extend(reps)
        # 1) direct: round robin over the replicas from the client itself
        lat = []
        per = max(1, n // replicas)
        for u in urls:
            lat += await _drive(u, per, concurrency, max_tokens, prompt_chars)
        results["direct"] = {"p50_ms": round(statistics.median(lat) * 1000, 3)}
        # 2) skymesh balancer
        # the config wants real ports; the balancer is told to bind port 0 and report it
        bport, gport = free_port(), free_port()
        cfg = {
            "model": "skymesh-sim",
            "regions": [{"name": "bench-1", "source_networks": ["127.1.0.0/16"],
                         "balancer": {"listen": f"127.0.0.1:{bport}", "grpc_listen": f"127.0.0.1:{gport}"},
                         "replicas": [{"id": f"r{i}", "url": u} for i, u in enumerate(urls)]}],
            "controller": {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}"},
            "dns": {"name": "llm.bench.local", "listen": f"127.0.0.1:{free_port(span=2)}"},
            "policy": {"name": "round_robin", "options": {"dispatch_budget": 64}},
            "offload": {"enabled": False},
        }
        # the byte fallback, and with a tokenizer (token-true prefixes) when one is given
        variants: list[tuple[str, dict[str, Any]]] = [("skymesh", {})]
        if tokenizer is not None:
            variants.append(("skymesh_tokenizer", {"tokenizer": {"path": tokenizer}}))
        for name, extra in variants:
            (tmp / f"{name}.yaml").write_text(yaml.safe_dump({**cfg, **extra}))
            b = Child(name, skymesh_cmd("balancer", "--config", str(tmp / f"{name}.yaml"), "--region", "bench-1",
                                        "--http-port", "0", "--no-controller", "--no-peers",
                                        "--log-level", "WARNING"), tmp)
            b.start()
            children.append(b)
            burl = f"http://127.0.0.1:{(await b.wait_ready())['http']}"
            results[name] = await _router_cost(b, burl, n, concurrency, max_tokens, prompt_chars)
            await b.stop()
        # 3) sglang-router, when installed
        sport = free_port()
        sgl = Child("sglang-router", [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                      "--port", str(sport), "--policy", "round_robin", "--worker-urls", *urls],
                    tmp, env={"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            results["sglang_router"] = f"not installed ({INSTALL_HINT})"
        else:
            sgl.start()
            children.append(sgl)
            surl = f"http://127.0.0.1:{sport}"
            await wait_healthy(surl + "/health", sgl, within_s=60)
            results["sglang_router"] = await _router_cost(sgl, surl, n, concurrency, max_tokens, prompt_chars)
        return results
    finally:
        for c in reversed(children):
            await c.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=0,
                   help="pad each prompt to this many characters (0: short prompts)")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json: also measure the balancer hashing token ids with it")
    p.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> int:
    res = asyncio.run(measure(args.requests, args.replicas, args.concurrency, args.max_tokens,
                              args.prompt_chars, os.path.abspath(args.tokenizer) if args.tokenizer else None))
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0
