"""Prefill/decode pairs live, on stand-ins: the DES comparison of ``benchmarks/pd_split.py``
run with real processes on loopback, plus vllm-router 0.1.17's P/D mode on the same pools.

Per cell (system x workload x run): ``--replicas`` fresh stand-in processes (``skymesh
replica-sim``, ``--profile`` at ``--time-scale``, each playing vLLM 0.32's NIXL pull
connector: ``--kv-transfer-port 0``), then the router under test, then the workload
replayed open loop by :mod:`skymesh.bench.loadgen` (every response streamed), bounded by
its request count and ``--timeout-s``. Systems:

- ``aggregated``: a skymesh balancer, every replica ``both``, pair rule ``never``;
- ``always@P:D`` / ``threshold@P:D`` / ``conductor@P:D``: a skymesh balancer whose first P
  replicas are ``prefill``, the next D ``decode``, the rest ``both``, with that pair rule
  (``conductor``: Mooncake's per-request choice; ``threshold``: the peers' 256 tokens);
- ``elastic@0:0``: every replica ``both``, the conductor over roles that follow the load
  (its role plan sets some decode-only and the rest prefill-only as the load asks);
- ``rule@P:D+option``: the skymesh rule with a boolean option of its own on (e.g.
  ``conductor@1:1+prefill_pool``);
- ``vllm-router@P:D``: vllm-router's ``--vllm-pd-disaggregation`` over the same P prefill
  and D decode replicas (P + D must be every replica: it has no ``both``), its default
  ``cache_aware`` policy for both pools (skipped with a message when not installed).

The skymesh balancers name each replica's ``sim:`` profile and time scale, so the pair
rules price steps as the stand-ins run them; the TBT target and the KV link are scaled
alike. Workloads (:mod:`skymesh.bench.pd_workloads`, outputs shortened so that the token
stream fits two shared cores): ``long`` (8-24K-token documents, prefill-heavy) and
``chat`` (0.5-1.5K-token turns). Rates and seconds are in profile time (the stand-ins'
time before scaling); the arrivals are replayed ``1 / time-scale`` faster.

Per cell, judged at the client: requests served, TTFT p50/p90, TBT (Mooncake's: the mean
of a request's longest 10% token intervals) p50/p90, the share meeting TTFT <= ``--ttft``
and TBT <= ``--tbt`` (of every request sent), the share split (KV pulls the stand-ins
counted, over requests served), and the router's CPU seconds per request (its process's
user + system time over the replay, from /proc). Times are reported in profile seconds.

    PYTHONPATH=. .venv/bin/python -m benchmarks.pd_live --runs 3 --out bench-out/pd_live.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks.pd_split import parse_system, system_options
from skymesh.bench.loadgen import LiveResult, replay
from skymesh.bench.pd_workloads import long_context, short_chat
from skymesh.bench.peers import (
    INSTALL_HINT,
    balancer_config,
    balancer_config_child,
    peer_available,
    vllm_router_pd_child,
)
from skymesh.bench.scores import summarize_arrays
from skymesh.bench.traces import TraceRequest, scale_rate
from skymesh.runtime.procs import Child, free_port, start_sim_replicas, wait_healthy
from skymesh.runtime.prom_text import parse_samples
from skymesh.word_tokenizer import trace_prompt

VLLM_ROUTER = "vllm-router"
DEFAULT_SYSTEMS = ("aggregated,always@3:1,always@2:2,threshold@3:1,conductor@1:1,"
                   "vllm-router@3:1,vllm-router@2:2")
PULLS = "vllm:nixl_xfer_time_seconds_count"
FAILED = "vllm:nixl_num_failed_transfers_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


@dataclass(frozen=True)
class Workload:
    make: Callable[..., list[TraceRequest]]
    rate: float  # req/s, profile time
    seconds: float  # of arrivals, profile time
    output_len: tuple[int, int]
    time_scale: float  # the stand-ins' step-time multiplier

    def trace(self, seed: int) -> list[TraceRequest]:
        return self.make(max(1, round(self.rate * self.seconds)), self.rate, output_len=self.output_len, seed=seed)


def pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    return {"long": Workload(long_context, args.long_rate, args.long_seconds, pair(args.long_output),
                             args.long_time_scale),
            "chat": Workload(short_chat, args.chat_rate, args.chat_seconds, pair(args.chat_output),
                             args.chat_time_scale)}


def pools(system: str, replicas: int) -> tuple[str, int, int]:
    """(rule or ``vllm-router``, P, D) of a system name (the options after ``+`` of a
    skymesh rule left out: :func:`benchmarks.pd_split.system_options`)."""
    rule, (p, d) = parse_system(system, replicas)
    if "+" in system and rule in (VLLM_ROUTER, "never"):
        raise ValueError(f"{system}: options are a skymesh pair rule's")
    if rule == VLLM_ROUTER and (p < 1 or d < 1 or p + d != replicas):
        raise ValueError(f"{system}: vllm-router's P/D mode needs P + D = {replicas} replicas, each >= 1")
    if rule not in (VLLM_ROUTER, "never", "always", "threshold", "conductor", "elastic"):
        raise ValueError(f"{system}: unknown system")
    return rule, p, d


def roles(p: int, d: int, replicas: int) -> list[str]:
    return ["prefill"] * p + ["decode"] * d + ["both"] * (replicas - p - d)


def bytes_per_token(trace: Sequence[TraceRequest]) -> float:
    """UTF-8 bytes per stand-in token of the prompts the load generator sends for ``trace``
    (a stand-in without a tokenizer counts whitespace words)."""
    prompts = [trace_prompt(r.hash_ids, r.input_len) for r in trace]
    return sum(len(t.encode()) for t in prompts) / max(1, sum(len(t.split()) for t in prompts))


def skymesh_config(rule: str, roles_: Sequence[str], ports: Sequence[int], args: argparse.Namespace,
                   ts: float, bpt: float, options: dict[str, bool] | None = None) -> dict[str, Any]:
    """One region: the stand-ins as ``sim:`` replicas (the pair rules price steps by their
    profile and time scale), their roles, and ``pairing:`` with the scaled TBT target and
    the stand-ins' KV link (its transfer time is scaled as their steps are); ``ts``: their
    time scale. ``bpt``: the workload's bytes per token, so that the balancer's prompt
    count (its byte estimate, no tokenizer) is the stand-ins': the pair rules size KV and
    price prefills by it (the default 4 bytes counted these prompts' words 3.7 times over,
    and a 1.5K-word prompt never fitted a 4,096-token decode replica)."""
    cfg = balancer_config(args.policy, [f"http://127.0.0.1:{p}" for p in ports], 0, args.ttft * ts)
    cfg["tokenizer"] = {"bytes_per_token": round(bpt, 3)}
    cfg["regions"][0]["replicas"] = [  # type: ignore[index]
        {"id": f"r{i}", "role": role, "sim": {"profile": args.profile, "port": port, "time_scale": ts}}
        for i, (role, port) in enumerate(zip(roles_, ports, strict=True))]
    if rule != "never":
        cfg["pairing"] = {"rule": rule, "tbt_slo_s": args.tbt * ts, "link_gbps": args.kv_gbps / ts,
                          "options": options or {}}
    return cfg


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (its threads included), from /proc."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tbt_of(itl: Sequence[float]) -> float:
    """Mooncake's TBT: the mean of the longest tenth of a request's token intervals (NaN
    without any)."""
    if not itl:
        return math.nan
    keep = max(1, math.ceil(0.1 * len(itl)))
    return float(np.mean(sorted(itl)[-keep:]))


async def stand_in_counters(urls: Sequence[str]) -> dict[str, float]:
    out = dict.fromkeys((PULLS, FAILED, EXPIRED), 0.0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for u in urls:
            async with s.get(u + "/metrics") as r:
                got = parse_samples(await r.text(), out)
            for k, v in got.items():
                out[k] += v
    return out


def cell_metrics(results: list[LiveResult], args: argparse.Namespace, ts: float) -> dict[str, Any]:
    """The cell's figures in profile seconds (wall seconds / ``ts``)."""

    def arr(vals: Sequence[float | None]) -> np.ndarray:
        return np.array([math.nan if v is None else v / ts for v in vals], dtype=float)

    served = [r.e2e is not None and r.tokens > 0 for r in results]
    tbt = np.array([tbt_of(r.itl) / ts if ok else math.nan for r, ok in zip(results, served, strict=True)])
    m = summarize_arrays(arr([r.arrival_s for r in results]), arr([r.ttft for r in results]),
                         arr([r.e2e for r in results]), np.array([r.output_len for r in results], dtype=float),
                         np.array([r.rejected for r in results]), np.zeros(len(results), dtype=bool), args.ttft,
                         tbt=tbt, tbt_slo_s=args.tbt)
    n = len(results)
    got = tbt[~np.isnan(tbt)]
    ttft = arr([r.ttft for r in results])
    return {"requests": n, "served": int(sum(served)), "met_both": m["slo_attainment"],
            "ttft_ok": round(float(np.count_nonzero(np.nan_to_num(ttft, nan=np.inf) <= args.ttft)) / n, 4),
            "tbt_ok": round(float(np.count_nonzero(got <= args.tbt)) / n, 4),
            "ttft_p50": m["ttft_p50"], "ttft_p90": m["ttft_p90"], "tbt_p50": m.get("tbt_p50"),
            "tbt_p90": m.get("tbt_p90"),
            # every token interval the client saw, pooled (what TBT's longest tenth come from)
            "itl_p50": round(float(np.median(itl)), 4) if (itl := [g / ts for r in results for g in r.itl]) else None,
            "short_streams": sum(1 for r, ok in zip(results, served, strict=True) if ok and r.tokens < r.output_len),
            "errors": sorted({r.error[:120] for r in results if r.error})[:5],
            "max_send_lateness_s": round(max((r.late_s for r in results), default=0.0), 4)}


async def run_cell(system: str, name: str, wl: Workload, trace: list[TraceRequest], args: argparse.Namespace,
                   tmp: Path, tag: str) -> dict[str, Any] | None:
    rule, p, d = pools(system, args.replicas)
    if rule == VLLM_ROUTER and not peer_available(VLLM_ROUTER):
        print(f"skipping {system}: vllm-router is not installed ({INSTALL_HINT})", file=sys.stderr)
        return None
    children: list[Child] = []
    try:
        reps, urls = await start_sim_replicas(
            args.replicas, args.profile, wl.time_scale, tmp, f"{tag}-r",
            extra=["--kv-transfer-port", "0", "--kv-bandwidth-gbps", str(args.kv_gbps)])
        children.extend(reps)
        if rule == VLLM_ROUTER:
            port = free_port()
            router = vllm_router_pd_child(urls[:p], urls[p:p + d], port, tmp, name=f"{tag}-router")
            assert router is not None  # installed: checked above
            router.start()
            children.append(router)
            url = f"http://127.0.0.1:{port}"
            await wait_healthy(url + "/health", router, within_s=60)
        else:
            cfg = skymesh_config(rule, roles(p, d, args.replicas), [c.port("http") for c in reps], args,
                                 wl.time_scale, bytes_per_token(trace), system_options(system))
            router = balancer_config_child(cfg, f"{tag}-router", 0, tmp)
            router.start()
            children.append(router)
            url = f"http://127.0.0.1:{(await router.wait_ready(60))['http']}"
            await wait_healthy(url + "/health", router, within_s=60)
        cpu0 = cpu_seconds(router.pid)
        t0 = time.perf_counter()
        results = await replay(scale_rate(trace, 1.0 / wl.time_scale), lambda _r: url, args.timeout_s)
        wall = time.perf_counter() - t0
        cpu1 = cpu_seconds(router.pid)
        counters = await stand_in_counters(urls)
    finally:
        await asyncio.gather(*(c.stop() for c in children))
    m = cell_metrics(results, args, wl.time_scale)
    m.update(system=system, workload=name, rule=rule, prefill=p, decode=d, wall_s=round(wall, 1),
             split_share=round(counters[PULLS] / m["served"], 4) if m["served"] else None,
             kv_failed=int(counters[FAILED]), kv_expired=int(counters[EXPIRED]),
             router_cpu_ms_per_request=(None if cpu0 is None or cpu1 is None
                                        else round(1000 * (cpu1 - cpu0) / len(results), 3)))
    return m


def mean_range(vals: Sequence[float | None], digits: int = 2) -> str:
    got = [v for v in vals if v is not None]
    if not got:
        return "—"
    f = f"{{:.{digits}f}}"
    return f"{f.format(np.mean(got))} [{f.format(min(got))}–{f.format(max(got))}]"


COLUMNS = (("met_both", "met TTFT and TBT", 2), ("ttft_ok", "met TTFT", 2), ("tbt_ok", "met TBT", 2),
           ("ttft_p50", "TTFT p50 (s)", 2), ("ttft_p90", "TTFT p90 (s)", 2), ("tbt_p50", "TBT p50 (s)", 3),
           ("tbt_p90", "TBT p90 (s)", 3), ("split_share", "split", 2),
           ("router_cpu_ms_per_request", "router CPU (ms/req)", 2))


def render(cells: list[dict[str, Any]], systems: Sequence[str]) -> str:
    """Per workload, a markdown table: each figure the mean [lowest–highest] over the runs."""
    out = []
    for name in dict.fromkeys(c["workload"] for c in cells):
        out += [f"**{name}**", "", "| system | served / sent | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
                "|---|---|" + "---|" * len(COLUMNS)]
        for s in systems:
            rows = [c for c in cells if c["workload"] == name and c["system"] == s]
            if not rows:
                continue
            served = f"{sum(r['served'] for r in rows)} / {sum(r['requests'] for r in rows)}"
            out.append(f"| {s} | {served} | " + " | ".join(mean_range([r[k] for r in rows], dg)
                                                            for k, _, dg in COLUMNS) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--workloads", default="long,chat")
    ap.add_argument("--runs", type=int, default=3, help="runs (arrival seeds 0..N-1), systems interleaved")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--profile", default="h100-qwen2.5-7b")
    ap.add_argument("--policy", default="dualmap", help="the skymesh balancers' policy (picks the prefill replica)")
    # per workload: rate and seconds of arrivals (profile time), output tokens (lowest,highest)
    # and the stand-ins' time scale (their step-time multiplier: the token stream's rate
    # on the wall clock is the profile's divided by it)
    ap.add_argument("--long-rate", type=float, default=4.0)
    ap.add_argument("--long-seconds", type=float, default=10.0)
    ap.add_argument("--long-output", default="32,128")
    ap.add_argument("--long-time-scale", type=float, default=1.0)
    ap.add_argument("--chat-rate", type=float, default=130.0)
    ap.add_argument("--chat-seconds", type=float, default=2.5)
    ap.add_argument("--chat-output", default="32,128")
    ap.add_argument("--chat-time-scale", type=float, default=5.0)
    ap.add_argument("--ttft", type=float, default=2.0, help="TTFT target, profile seconds")
    ap.add_argument("--tbt", type=float, default=0.1, help="TBT target, profile seconds")
    ap.add_argument("--kv-gbps", type=float, default=100.0, help="the KV link (the stand-ins' modelled pull)")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="wall-clock bound per cell's replay")
    ap.add_argument("--out", default="bench-out/pd_live.json")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="print the tables of a written JSON (a run stopped early included) and exit")
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        print(render(doc["cells"], [s for s in doc["config"]["systems"].split(",") if s]))
        return 0
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        pools(s, args.replicas)
    loads = workloads(args)
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in loads:
            ap.error(f"unknown workload {w!r} (known: {', '.join(loads)})")
    os.environ.setdefault("SKYMESH_ADMIN_TOKEN", secrets.token_urlsafe(32))  # the balancers inherit it
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="pd-live-"))
    cells: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        for run in range(args.runs):
            for name in names:
                trace = loads[name].trace(seed=run)
                for s in systems:
                    tag = f"{s.replace('@', '-').replace(':', '-')}-{name}-{run}"
                    m = asyncio.run(run_cell(s, name, loads[name], trace, args, tmp, tag))
                    if m is None:
                        continue
                    m["run"] = run
                    cells.append(m)
                    print(json.dumps({k: m[k] for k in ("system", "workload", "run", "served", "requests", "met_both",
                                                        "ttft_p90", "tbt_p90", "split_share",
                                                        "router_cpu_ms_per_request", "wall_s")}), flush=True)
                    # after every cell: a run stopped early keeps what it measured
                    out.write_text(json.dumps({"config": vars(args), "cells": cells}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    config = vars(args) | {"wall_s_total": round(time.perf_counter() - t_start, 1)}
    out.write_text(json.dumps({"config": config, "cells": cells}, indent=1))
    print(render(cells, systems))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
