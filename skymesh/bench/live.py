"""`skymesh bench trace --trace FILE --systems a,b,c --out DIR`: live trace replay.

For every system, fresh stand-in replica processes (same profile, same count) are started,
then the router under test: a skymesh balancer with policy NAME (any registry name), or
the real peers `sglang-router` / `vllm-router` (optional extra `[peers]`) in front of the
same replicas. The trace's first requests are replayed open-loop on their (rate-scaled)
arrival times — the generator never waits for responses — each prompt built from its
hash ids (skymesh.tokens.trace_prompt), every response streamed; TTFT, E2E and the
serving replica are recorded. Load loops are bounded by --requests and --timeout-s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from skymesh.bench.metrics import summarize
from skymesh.bench.report import markdown_table, write_report
from skymesh.bench.sim_main import DEFAULT_TRACE
from skymesh.bench.traces import load_mooncake, oracle_hit_rate, scale_rate
from skymesh.procs import Child, free_port, skymesh_cmd, start_sim_replicas, wait_healthy
from skymesh.prom import parse_samples
from skymesh.tokens import trace_prompt

PEERS = {"sglang-router", "vllm-router"}


@dataclass(slots=True)
class LiveResult:
    arrival_s: float
    output_len: int
    ttft: float | None = None
    e2e: float | None = None
    rejected: bool = False
    offloaded: bool = False
    replica: str = ""


async def _one(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, res: LiveResult,
               t_start: float) -> None:
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    sent = time.perf_counter()
    try:
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.rejected = True
                await r.read()
                return
            res.replica = r.headers.get("X-Skymesh-Replica", "")
            async for chunk in r.content.iter_any():
                if res.ttft is None and b"data: {" in chunk:
                    res.ttft = time.perf_counter() - sent
            res.e2e = time.perf_counter() - sent
    except (TimeoutError, aiohttp.ClientError):
        res.rejected = True


async def replay(url: str, trace: list[Any], timeout_s: float) -> list[LiveResult]:
    results = [LiveResult(r.arrival_s, r.output_len) for r in trace]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        t0 = time.perf_counter()
        tasks = []
        for r, res in zip(trace, results, strict=True):
            delay = r.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # open loop: on time, never waiting for answers
            tasks.append(asyncio.create_task(_one(s, url, trace_prompt(r.hash_ids, r.input_len), r.output_len,
                                                  res, t0)))
        await asyncio.wait(tasks, timeout=timeout_s)
        for t in tasks:
            t.cancel()
    return results


async def _prefix_hits(urls: list[str]) -> float | None:
    q = h = 0.0
    async with aiohttp.ClientSession() as s:
        for u in urls:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(u + "/metrics") as r:
                    m = parse_samples(await r.text(), ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"))
                    q += m.get("vllm:prefix_cache_queries_total", 0.0)
                    h += m.get("vllm:prefix_cache_hits_total", 0.0)
    return h / q if q else None


def _router_child(system: str, urls: list[str], tmp: Path, port: int) -> Child | None:
    if system == "sglang-router":
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            return None
        return Child(system, [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                              "--port", str(port), "--policy", "cache_aware", "--worker-urls", *urls], tmp,
                     env={"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
    if system == "vllm-router":
        exe = shutil.which("vllm-router")
        if exe is None:
            return None
        return Child(system, [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                              "--worker-urls", *urls], tmp, env={"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
    cfg = {
        "model": "skymesh-sim",
        "regions": [{"name": "bench-1", "source_networks": ["127.1.0.0/16"],
                     "balancer": {"listen": f"127.0.0.1:{port}", "grpc_listen": f"127.0.0.1:{free_port()}"},
                     "replicas": [{"id": f"r{i}", "url": u} for i, u in enumerate(urls)]}],
        "controller": {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}"},
        "dns": {"name": "llm.bench.local", "listen": f"127.0.0.1:{free_port()}"},
        "policy": {"name": system, "ttft_slo_s": 2.0, "queue_bound": 100000, "chunk_tokens": 512},
        "offload": {"enabled": False},
    }
    path = tmp / f"{system}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Child(system, skymesh_cmd("balancer", "--config", str(path), "--region", "bench-1", "--no-controller",
                                     "--no-peers", "--log-level", "WARNING"), tmp)


async def run_system(system: str, trace: list[Any], args: argparse.Namespace, tmp: Path) -> dict[str, Any] | None:
    children: list[Child] = []
    try:
        reps, urls = await start_sim_replicas(args.replicas, args.profile, args.time_scale, tmp, f"{system}-replica")
        children.extend(reps)
        rport = free_port()
        router = _router_child(system, urls, tmp, rport)
        if router is None:
            print(f"skipping {system}: not installed (pip install '.[peers]')", file=sys.stderr)
            return None
        router.start()
        children.append(router)
        rurl = f"http://127.0.0.1:{rport}"
        await wait_healthy(rurl + "/health", router, within_s=60)
        results = await replay(rurl, trace, args.timeout_s)
        hit = await _prefix_hits(urls)
        slo = args.slo * args.time_scale
        m = summarize(results, slo, hit)
        m["slo_s_scaled"] = slo
        return m | {"_ttfts": [r.ttft for r in results if r.ttft is not None]}
    finally:
        for c in reversed(children):
            await c.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--systems", default="dualmap,prefix_tree,cache_aware,round_robin,sglang-router,vllm-router")
    p.add_argument("--out", default="bench-out/live")
    p.add_argument("--requests", type=int, default=300, help="first N trace requests")
    p.add_argument("--rate-scale", type=float, default=1.0, help="arrival-rate multiplier")
    p.add_argument("--time-scale", type=float, default=0.05, help="replica speed-up (the SLO scales with it)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--profile", default="h100-qwen2.5-7b")
    p.add_argument("--slo", type=float, default=2.0, help="TTFT SLO at time scale 1")
    p.add_argument("--timeout-s", type=float, default=300.0)


def run(args: argparse.Namespace) -> int:
    trace = load_mooncake(args.trace, args.requests)
    # compress time together with the replicas so the load ratio is the trace's
    trace = scale_rate(trace, args.rate_scale / args.time_scale)
    tmp = Path(tempfile.mkdtemp(prefix="skymesh-live-"))
    systems: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    try:
        for system in [s for s in args.systems.split(",") if s]:
            m = asyncio.run(run_system(system, trace, args, tmp))
            if m is None:
                continue
            ttfts[system] = m.pop("_ttfts")
            systems[system] = m
            print(f"{system}: slo_attainment={m['slo_attainment']} ttft_p50={m['ttft_p50']}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    config = {"trace": args.trace, "requests": len(trace), "replicas": args.replicas, "profile": args.profile,
              "time_scale": args.time_scale, "rate_scale": args.rate_scale, "slo_s": args.slo * args.time_scale,
              "oracle_prefix_hit_rate": round(oracle_hit_rate(trace), 4), "mode": "live"}
    write_report(Path(args.out), systems, config, {}, ttfts)
    print(markdown_table(systems))
    return 0
