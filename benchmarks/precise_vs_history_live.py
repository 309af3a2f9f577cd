"""Precise (KV events) vs approximate (routing history), live: real processes on loopback.

For every policy, view, seed and rate: fresh stand-in replica processes (``skymesh
replica-sim``, profile ``tiny-test``: 4,096 tokens of KV each, 16-token blocks) started
with a tokenizer trained here (nothing downloaded), publishing KV events (ZMQ on loopback)
and reporting cached prompt tokens in usage (``--enable-prompt-tokens-details``), then one
balancer child (``skymesh balancer``) with ``tokenizer.path`` and ``chunk_tokens`` = the
block size. View ``events``: every replica's ``kv_events`` is set, the balancer indexes the
stand-ins' events. View ``history``: the same balancer config without ``kv_events`` (the
routing-history trie, same chunks). The same text requests (per seed) are replayed open
loop at each rate of ``--rates`` (bounded in count and in wall time), every response
streamed with its usage; then the stand-ins' ``vllm:prefix_cache_*`` counters give the
prefix hit rate and the balancer's ``skymesh_cache_predictions_total`` the share of
requests whose predicted cached prefix (the policy's ``Decision.matched_tokens``) was
within one block of the replica's own count. Goodput per (policy, view, seed): the
monotone rule over the rates (``skymesh.bench.scores.monotone_goodput``, attainment ≥ 0.9).

Workload ("many customers, each with a long shared context"): ``--customers`` contexts of
``--context-tokens`` tokens (Zipf popularity), a share ``--hot-share`` of the requests start
with one of them, the rest with a context of their own; each adds ``--question-tokens``
tokens of its own and asks for ``--output-tokens``. Every word is one token of the trained
tokenizer (checked), so the lengths are token counts.

Usage::

    .venv/bin/python -m benchmarks.precise_vs_history_live --seeds 0,1 --rates 5,7,9,11 --at 9 \\
        --out bench-out/precise_vs_history_live.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from skymesh.assets.bpe import train_byte_bpe
from skymesh.bench.loadgen import LiveResult, prefix_hit_rate, send_one
from skymesh.bench.peers import balancer_config
from skymesh.bench.scores import monotone_goodput, summarize
from skymesh.hardware import PROFILES
from skymesh.runtime.procs import Child, skymesh_cmd, wait_all_ready
from skymesh.runtime.prom_text import parse_samples
from skymesh.security.admin_auth import admin_headers

BLOCK = 16
EST = "skymesh_prefix_hit_estimate_ratio"
JUDGED = tuple(f'skymesh_cache_predictions_total{{cache_source="{src}",result="{r}"}}'
               for src in ("events", "routing-history") for r in ("within_block", "over", "under"))
# letters only: GPT-2's pre-tokenizer splits letters from digits
VOCAB = [a + b + c for a in "bcdfgh" for b in "aeiou" for c in "klmnprstvz"][:300]


def train_tokenizer(path: Path) -> None:
    """A byte-level BPE in which every word of VOCAB (with its leading space) is one token."""
    from tokenizers import Tokenizer

    rnd = random.Random(0)
    corpus = (" ".join(rnd.choice(VOCAB) for _ in range(200)) for _ in range(1000))
    train_byte_bpe(corpus, 4000, add_prefix_space=True).save(str(path))
    probe = " ".join(VOCAB)
    n = len(Tokenizer.from_file(str(path)).encode(probe).ids)
    assert n == len(VOCAB), f"{n} tokens for {len(VOCAB)} words"


def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(VOCAB) for _ in range(n))


def workload(args: argparse.Namespace, seed: int, rate: float) -> list[tuple[float, str, int]]:
    """(arrival s, prompt, max_tokens) for every request, Poisson at ``rate``: the same
    prompts in the same order at every rate of a seed (only the gaps scale)."""
    rnd = random.Random(seed)
    gaps = random.Random(seed + 1_000_003)
    contexts = [words(rnd, args.context_tokens) for _ in range(args.customers)]
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.customers)]
    out = []
    t = 0.0
    for _ in range(args.requests):
        t += gaps.expovariate(1.0) / rate
        ctx = (rnd.choices(contexts, weights)[0] if rnd.random() < args.hot_share
               else words(rnd, args.context_tokens))
        out.append((t, ctx + " " + words(rnd, args.question_tokens), args.output_tokens))
    return out


async def start_replicas(args: argparse.Namespace, tok: Path, tmp: Path, tag: str) -> list[Child]:
    reps = []
    for i in range(args.replicas):
        # the stand-in binds tcp://*:0 on its --host (loopback) and reports the ports
        ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}
        reps.append(Child(f"{tag}-r{i}", skymesh_cmd(
            "replica-sim", "--host", "127.0.0.1", "--port", "0", "--profile", args.profile,
            "--time-scale", str(args.time_scale), "--log-level", "ERROR", "--tokenizer", str(tok),
            "--kv-events-config", json.dumps(ev), "--enable-prompt-tokens-details"), tmp))
    try:
        for c in reps:
            c.start()
        await wait_all_ready(reps, 60)
    except BaseException:
        await asyncio.gather(*(c.stop() for c in reps))
        raise
    return reps


async def run_cell(policy: str, view: str, seed: int, rate: float, reqs: list[tuple[float, str, int]],
                   args: argparse.Namespace, tok: Path, tmp: Path) -> dict[str, Any]:
    tag = f"{policy}-{view}-{seed}-{rate}"
    children: list[Child] = []
    try:
        reps = await start_replicas(args, tok, tmp, tag)
        children.extend(reps)
        urls = [f"http://127.0.0.1:{c.port('http')}" for c in reps]
        cfg: dict[str, Any] = balancer_config(policy, urls, 0, args.slo, chunk_tokens=BLOCK)
        cfg["tokenizer"] = {"path": str(tok)}
        if view == "events":
            for i, r in enumerate(cfg["regions"][0]["replicas"]):  # type: ignore[index]
                r["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{reps[i].port('kv_events')}",
                                  "replay_endpoint": f"tcp://127.0.0.1:{reps[i].port('kv_replay')}"}
        path = tmp / f"{tag}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        bal = Child(f"balancer-{tag}", skymesh_cmd("balancer", "--config", str(path), "--region", "bench-1",
                                                   "--http-port", "0", "--no-controller", "--no-peers",
                                                   "--log-level", "WARNING"), tmp)
        bal.start()
        children.append(bal)
        url = f"http://127.0.0.1:{(await bal.wait_ready(60))['http']}"
        await asyncio.sleep(0.5)  # the subscribers connect
        results = [LiveResult(a, len(p.split()), m) for a, p, m in reqs]
        timeout = aiohttp.ClientTimeout(total=args.timeout_s)
        t_end = time.perf_counter() + args.timeout_s
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
            tasks = []
            t0 = time.perf_counter()
            for (a, p, m), res in zip(reqs, results, strict=True):
                delay = a - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                res.late_s = max(0.0, time.perf_counter() - t0 - a)
                tasks.append(asyncio.create_task(send_one(s, url, p, m, res, include_usage=True)))
            await asyncio.wait(tasks, timeout=max(0.1, t_end - time.perf_counter()))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        hit = await prefix_hit_rate(urls)
        status = None
        predicted = None
        async with aiohttp.ClientSession() as s:
            # the policy's expected hit share per request (Decision.matched_tokens / prompt
            # tokens), averaged: every prompt has the same length, so it compares with the
            # stand-ins' token hit rate
            async with s.get(url + "/metrics") as r:
                pm = parse_samples(await r.text(), (f"{EST}_sum", f"{EST}_count", *JUDGED))
            if pm.get(f"{EST}_count"):
                predicted = round(pm[f"{EST}_sum"] / pm[f"{EST}_count"], 4)
            judged = {r: sum(pm.get(k, 0.0) for k in JUDGED if f'result="{r}"' in k)
                      for r in ("within_block", "over", "under")}
            try:
                async with s.get(url + "/admin/status",
                                 headers=admin_headers(os.environ["SKYMESH_ADMIN_TOKEN"])) as r:
                    status = await r.json() if r.status == 200 else None
            except Exception:  # noqa: BLE001 - diagnostics only
                status = None
        m = summarize(results, args.slo, hit, warmup_s=args.warmup_s)
        n_judged = sum(judged.values())
        m.update(judged={k: int(v) for k, v in judged.items()},
                 within_block=round(judged["within_block"] / n_judged, 4) if n_judged else None,
                 over_predicted=round(judged["over"] / n_judged, 4) if n_judged else None)
        m.update(policy=policy, view=view, seed=seed, rate=rate,
                 max_send_lateness_s=round(max(r.late_s for r in results), 4),
                 errors=sum(1 for r in results if r.ttft is None), predicted_hit_rate=predicted)
        if status is not None:
            m["cache_sources"] = sorted({str(v.get("cache_source")) for v in status.get("replicas", {}).values()})
        return m
    finally:
        for c in reversed(children):
            await c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="prefix_tree,preble,dualmap,min_ttft,cache_aware")
    ap.add_argument("--views", default="events,history")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--profile", default="tiny-test")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=14.0, help="the stand-ins' step-time multiplier")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rates", default="5,7,9,11", help="req/s, wall clock: the goodput sweep")
    ap.add_argument("--at", type=float, default=9.0, help="the rate whose cells the other columns show")
    ap.add_argument("--customers", type=int, default=16)
    ap.add_argument("--context-tokens", type=int, default=768)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--hot-share", type=float, default=0.9)
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--slo", type=float, default=1.0, help="TTFT SLO, wall-clock s")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--timeout-s", type=float, default=90.0, help="wall-clock bound per cell")
    ap.add_argument("--out", default="bench-out/precise_vs_history_live.json")
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    if args.at not in rates:
        ap.error("--at must be one of --rates")
    seeds = [int(x) for x in args.seeds.split(",")]
    kv = PROFILES[args.profile].num_gpu_blocks * BLOCK * args.replicas
    print(f"customer contexts: {args.customers * args.context_tokens} tokens = "
          f"{args.customers * args.context_tokens / kv:.0%} of {kv} tokens of KV", flush=True)
    os.environ.setdefault("SKYMESH_ADMIN_TOKEN", secrets.token_urlsafe(32))  # the balancers inherit it
    tmp = Path(tempfile.mkdtemp(prefix="pvh-live-"))
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tok = tmp / "tokenizer.json"
        train_tokenizer(tok)
        for seed in seeds:
            for rate in rates:
                reqs = workload(args, seed, rate)
                for policy in args.policies.split(","):
                    for view in args.views.split(","):
                        t = time.perf_counter()
                        m = asyncio.run(run_cell(policy, view, seed, rate, reqs, args, tok, tmp))
                        m["wall_s"] = round(time.perf_counter() - t, 1)
                        rows.append(m)
                        print(json.dumps({k: m.get(k) for k in (
                            "policy", "view", "seed", "rate", "ttft_p90", "slo_attainment", "prefix_hit_rate",
                            "predicted_hit_rate", "within_block", "over_predicted", "judged", "errors",
                            "max_send_lateness_s", "cache_sources", "wall_s")}), flush=True)
                        # written after every cell: a long run stopped early keeps what it measured
                        out.write_text(json.dumps({"config": vars(args), "kv_tokens": kv, "rows": rows}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(rows, args.policies.split(","), args.views.split(","), seeds, args.at))


def table(rows: list[dict[str, Any]], policies: list[str], views: list[str], seeds: list[int], at: float) -> str:
    """Markdown: goodput per seed (monotone over the swept rates) and its mean and spread
    (max - min), then the cells at rate ``at``, values seed by seed."""
    lines = ["| policy | view | goodput (req/s) per seed | mean (spread) | P90 TTFT (s) | SLO attainment | "
             "prefix hit rate | predicted within 1 block | over-predicted |", "|---|---|---|---|---|---|---|---|---|"]
    for policy in policies:
        for view in views:
            cells = [r for r in rows if r["policy"] == policy and r["view"] == view]
            if not cells:
                continue
            gps = [monotone_goodput([(r["rate"], r["slo_attainment"]) for r in cells if r["seed"] == sd])
                   for sd in seeds]
            at_rate = [next((r for r in cells if r["seed"] == sd and r["rate"] == at), {}) for sd in seeds]

            def f(k: str, at_rate: list[dict[str, Any]] = at_rate) -> str:
                return " / ".join(str(r.get(k)) for r in at_rate)
            lines.append(f"| {policy} | {view} | {' / '.join(f'{g:.2f}' for g in gps)} | "
                         f"{sum(gps) / len(gps):.2f} ({max(gps) - min(gps):.2f}) | {f('ttft_p90')} | "
                         f"{f('slo_attainment')} | {f('prefix_hit_rate')} | {f('within_block')} | "
                         f"{f('over_predicted')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
