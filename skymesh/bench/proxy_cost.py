"""`skymesh bench proxy`: balancer CPU per proxied request, on loopback.

In one run, against the same stand-in replicas (time scale tiny, so the replicas answer
at once): (1) requests straight to the replicas (the direct baseline: client latency),
(2) through a skymesh balancer (its process CPU per request, from /proc), (3) through
sglang-router and vllm-router (round_robin) when they are installed (`.venv/bin/pip install
-e '.[peers]'`; ``--peers`` picks which). The routers run as their own processes; CPU is
user+system time of that process tree, less its idle CPU over the same wall time.

``--tracing`` adds the balancer with OpenTelemetry tracing on (every request sampled,
and none: ``sampling_ratio`` 0), exporting to a sink in this process; ``--baseline-src
DIR`` (repeatable) adds the balancer of another source tree (e.g. the commit before a change), tracing
off both; ``--stdlib-loop`` adds the balancer on the stdlib event loop instead of uvloop
(``SKYMESH_EVENT_LOOP=asyncio``, skymesh/runtime/event_loop.py). ``--rounds N`` runs every
variant and peer router N times in turn (each round starting one further on) and reports
each one's median; ``ratios`` divides each variant's CPU by the plain balancer's of the
same run, ``ratios_to_sglang_router`` (and ``_vllm_router``) each one's by that router's of
the same round (median, lowest, highest and every round's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from skymesh.bench.peers import INSTALL_HINT, PEERS, peer_available, peer_child
from skymesh.runtime.event_loop import ENV_VAR, STDLIB, loop_factory
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


class TraceSink:
    """An OTLP/HTTP endpoint that takes the balancer's span batches and keeps only their
    count and size (a collector's work is not the balancer's CPU)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.batches = 0
        self.bytes = 0
        self._runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    async def _traces(self, request: web.Request) -> web.Response:
        self.batches += 1
        self.bytes += len(await request.read())
        return web.Response(content_type="application/x-protobuf")  # an empty ExportTraceServiceResponse

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def _round_ratios(runs: list[dict[str, float]], reference: list[dict[str, float]]) -> dict[str, Any]:
    """CPU per request of ``runs`` over ``reference``'s, round by round: the median, the
    lowest and highest, and every round's."""
    each = [round(r["cpu_us_per_request"] / ref["cpu_us_per_request"], 3) for r, ref in zip(runs, reference, strict=True)]
    return {"median": round(statistics.median(each), 3), "min": min(each), "max": max(each), "rounds": each}


def _median_of(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Each figure's median over the rounds (and, with several, every round's CPU)."""
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    if len(runs) > 1:
        out["cpu_us_per_request_rounds"] = [r["cpu_us_per_request"] for r in runs]
    return out


async def measure(n: int, replicas: int, concurrency: int, max_tokens: int, prompt_chars: int = 0,
                  tokenizer: str | None = None, tracing: bool = False,
                  baseline_src: str | list[str] | None = None,
                  rounds: int = 1, stdlib_loop: bool = False,
                  peers: tuple[str, ...] = PEERS) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="skymesh-proxy-"))
    children: list[Child] = []
    results: dict[str, Any] = {"requests": n, "concurrency": concurrency, "replicas": replicas,
                               "max_tokens": max_tokens, "prompt_chars": prompt_chars, "tokenizer": tokenizer,
                               "rounds": rounds, "event_loop": loop_factory()[0]}
    sink = TraceSink()
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
        # the byte fallback, and with a tokenizer (token-true prefixes) when one is given;
        # (name, config keys, environment: another source tree's balancer, another loop)
        variants: list[tuple[str, dict[str, Any], dict[str, str] | None]] = [("skymesh", {}, None)]
        if stdlib_loop:
            variants.append(("skymesh_stdlib_loop", {}, {ENV_VAR: STDLIB}))
        baselines = [baseline_src] if isinstance(baseline_src, str) else list(baseline_src or [])
        for i, src in enumerate(baselines):
            # the first is "skymesh_baseline" (as with one), the others "skymesh_baseline_2", ...
            name = "skymesh_baseline" if i == 0 else f"skymesh_baseline_{i + 1}"
            variants.append((name, {}, {"PYTHONPATH": src}))
            results.setdefault("baseline_src", {})[name] = src
        if tracing:
            await sink.start()
            batch = {"schedule_delay_ms": 200}
            variants.append(("skymesh_tracing_sampled",
                             {"tracing": {"endpoint": sink.endpoint, "sampling_ratio": 1.0, "batch": batch}}, None))
            variants.append(("skymesh_tracing_unsampled",
                             {"tracing": {"endpoint": sink.endpoint, "sampling_ratio": 0.0, "batch": batch}}, None))
        if tokenizer is not None:
            variants.append(("skymesh_tokenizer", {"tokenizer": {"path": tokenizer}}, None))
        # 3) the peer routers (round_robin), when installed: measured in the same rounds
        routers: list[str] = []
        for system in peers:
            key = system.replace("-", "_")
            if peer_available(system):
                routers.append(system)
            else:
                results[key] = f"not installed ({INSTALL_HINT})"
        names = [name for name, _, _ in variants] + routers
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        by_name = {name: (extra, env) for name, extra, env in variants}
        for round_no in range(rounds):
            # each round starts one variant further on: none always runs first or after the same one
            start = round_no % len(names)
            for name in names[start:] + names[:start]:
                if name in by_name:
                    extra, env = by_name[name]
                    (tmp / f"{name}.yaml").write_text(yaml.safe_dump({**cfg, **extra}))
                    # another tree's balancer runs from that tree: `python -m` puts the working
                    # directory first on sys.path, ahead of PYTHONPATH (from this clone's root it
                    # would import this tree's skymesh, whatever PYTHONPATH says)
                    src = (env or {}).get("PYTHONPATH")
                    child = Child(name, skymesh_cmd("balancer", "--config", str(tmp / f"{name}.yaml"), "--region",
                                                    "bench-1", "--http-port", "0", "--no-controller", "--no-peers",
                                                    "--log-level", "WARNING"), tmp, env=env,
                                  cwd=Path(src) if src else None)
                    child.start()
                    children.append(child)
                    url = f"http://127.0.0.1:{(await child.wait_ready())['http']}"
                else:
                    port = free_port()
                    made = peer_child(name, urls, port, tmp, policy="round_robin")
                    assert made is not None  # installed: checked above
                    child = made
                    child.start()
                    children.append(child)
                    url = f"http://127.0.0.1:{port}"
                    await wait_healthy(url + "/health", child, within_s=60)
                runs[name].append(await _router_cost(child, url, n, concurrency, max_tokens, prompt_chars))
                await child.stop()
                children.remove(child)
        for name, measured in runs.items():
            results[name.replace("-", "_")] = _median_of(measured)
        if len(variants) > 1:
            plain = results["skymesh"]["cpu_us_per_request"]
            results["ratios"] = {name: round(results[name]["cpu_us_per_request"] / plain, 3)
                                 for name, _, _ in variants[1:]}
        for router in routers:
            # each balancer variant's CPU over the router's, round by round (the same
            # round's conditions), then their median and spread
            results[f"ratios_to_{router.replace('-', '_')}"] = {
                name: _round_ratios(runs[name], runs[router]) for name in names if name != router}
        if tracing:
            results["trace_sink"] = {"batches": sink.batches, "bytes": sink.bytes}
        return results
    finally:
        for c in reversed(children):
            await c.stop()
        await sink.stop()
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
    p.add_argument("--tracing", action="store_true",
                   help="also measure the balancer with OpenTelemetry tracing on (all sampled, and none)")
    p.add_argument("--baseline-src", default=None, action="append",
                   help="a source tree (its skymesh/ package) whose balancer is measured too, e.g. the "
                        "commit before a change (git archive REV | tar -x -C DIR); repeat it for several "
                        "(skymesh_baseline, skymesh_baseline_2, ...)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the balancer variants this many times in turn; each one's median is reported")
    p.add_argument("--stdlib-loop", action="store_true",
                   help="also measure the balancer on the stdlib event loop (SKYMESH_EVENT_LOOP=asyncio)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="the peer routers measured in the same rounds, when installed (comma-separated; "
                        "empty: none)")
    p.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> int:
    res = asyncio.run(measure(args.requests, args.replicas, args.concurrency, args.max_tokens,
                              args.prompt_chars, os.path.abspath(args.tokenizer) if args.tokenizer else None,
                              tracing=args.tracing,
                              baseline_src=[os.path.abspath(b) for b in args.baseline_src or []],
                              rounds=args.rounds, stdlib_loop=args.stdlib_loop,
                              peers=tuple(p for p in args.peers.split(",") if p)))
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0
