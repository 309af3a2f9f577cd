"""Routing decision-time micro-benchmark (`skymesh bench routing`).

Each policy first gets its prefix trie filled to its bound with realistic prompts (a few
shared system prompts + unique conversations, ~2k tokens, 64-token chunks); then every
measured request is one ``choose`` + ``on_dispatch`` (``choose`` alone when the policy
holds the request) with the same views a balancer would pass (all replicas, a random
quarter unavailable, random loads). Times come from perf_counter_ns around the two calls
only; prompt hashing is done before (the balancer does it once at admission).

It lives here, not in ``skymesh/routing/``, because it reads the clock, writes files and
tunes the collector: the routing package stays pure (``tests/test_routing_purity.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from skymesh.routing.base import PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.hashing import chunk_hashes
from skymesh.routing.registry import POLICIES, make_policy
from skymesh.runtime.gc_tuning import tune_gc


def _requests(
    n: int, rng: random.Random, chunk_tokens: int, prompt_tokens: int, first_id: int = 0
) -> list[RoutingRequest]:
    """Prompts of ``prompt_tokens`` words: one of 8 shared system prompts (256, 512 or
    1024 words) followed by a conversation unique to the request."""
    systems = [[f"sys{s}w{i}" for i in range(rng.choice((256, 512, 1024)))] for s in range(8)]
    out = []
    for i in range(first_id, first_id + n):
        sys_words = systems[rng.randrange(len(systems))]
        convo = [f"c{i}w{k}" for k in range(max(1, prompt_tokens - len(sys_words)))]
        words = sys_words + convo
        out.append(
            RoutingRequest(f"b{i}", chunk_hashes(words, chunk_tokens), len(words), float(i) * 1e-3)
        )
    return out


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def _summary(values: list[float]) -> tuple[float, float, float]:
    values.sort()
    return (
        round(_percentile(values, 0.50), 2),
        round(_percentile(values, 0.99), 2),
        round(sum(values) / max(1, len(values)), 2),
    )


def run_routing_bench(
    replica_counts: tuple[int, ...] = (8, 32, 128),
    policies: tuple[str, ...] = tuple(POLICIES),
    n_requests: int = 20_000,
    trie_max_nodes: int = PolicyContext().trie_max_nodes,
    prompt_tokens: int = 2048,
    chunk_tokens: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Decision time per (policy, replica count) with every trie filled to its bound.

    The prompts are generated and hashed once and replayed to every policy (hashing is
    the balancer's admission work, not the decision's). Each result row has p50/p99/mean
    in µs of the decision (``choose``), of the bookkeeping (``on_dispatch``) and of both.
    """
    gen = random.Random(seed)
    per_prompt = max(1, -(-prompt_tokens // chunk_tokens))
    # enough unique conversations to overflow the bound, so eviction runs all along
    fill = _requests(trie_max_nodes // per_prompt + 200, gen, chunk_tokens, prompt_tokens)
    reqs = _requests(n_requests, gen, chunk_tokens, prompt_tokens, first_id=len(fill))
    tune_gc()  # the same collector settings the balancer daemon runs with
    ctx = PolicyContext(chunk_tokens=chunk_tokens, trie_max_nodes=trie_max_nodes, seed=seed)
    results: dict[str, Any] = {}
    for n_rep in replica_counts:
        ids = [f"r{i}" for i in range(n_rep)]
        for name in policies:
            rng = random.Random(seed)
            policy = make_policy(name, ctx)
            policy.set_replicas(ids)
            views = {rid: ReplicaView(rid) for rid in ids}
            for i, r in enumerate(fill):
                policy.on_dispatch(r, ids[i % n_rep], r.arrival)
            decision: list[float] = []
            book: list[float] = []
            total: list[float] = []
            now = 10.0
            for r in reqs:
                # a quarter of the replicas busy and the load varying, per request
                for v in views.values():
                    v.available = rng.random() > 0.25
                    v.pending_prefill_tokens = rng.randrange(4096)
                    v.in_flight = rng.randrange(8)
                views[ids[0]].available = True  # the balancer only asks when one is free
                now += 1e-3
                # waited long: past any max_hold_fraction hold (DualMap may still hold it
                # for a faster busy candidate: then choose alone is timed)
                r.arrival = now - 5.0
                t0 = time.perf_counter_ns()
                d = policy.choose(r, views, now)
                t1 = time.perf_counter_ns()
                if d.replica_id is not None:
                    policy.on_dispatch(r, d.replica_id, now)
                t2 = time.perf_counter_ns()
                decision.append((t1 - t0) / 1000.0)
                book.append((t2 - t1) / 1000.0)
                total.append((t2 - t0) / 1000.0)
                if d.replica_id is not None:
                    policy.on_complete(r, d.replica_id, True, now)
            # a cache-tracking policy reports its routing history's size in its stats
            trie_nodes = policy.stats().get("trie", {}).get("nodes", 0)
            d50, d99, dmean = _summary(decision)
            b50, b99, _ = _summary(book)
            t50, t99, _ = _summary(total)
            results[f"{name}@{n_rep}"] = {
                "policy": name,
                "replicas": n_rep,
                "p50_us": d50,
                "p99_us": d99,
                "mean_us": dmean,
                "dispatch_p50_us": b50,
                "dispatch_p99_us": b99,
                "total_p50_us": t50,
                "total_p99_us": t99,
                "trie_nodes": trie_nodes,
            }
    return results


def render_table(results: dict[str, Any]) -> str:
    lines = [
        "| policy | replicas | decision p50 µs | decision p99 µs | bookkeeping p50 µs "
        "| bookkeeping p99 µs | total p50 µs | total p99 µs | trie nodes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        lines.append(
            f"| {r['policy']} | {r['replicas']} | {r['p50_us']} | {r['p99_us']} | {r['dispatch_p50_us']} "
            f"| {r['dispatch_p99_us']} | {r['total_p50_us']} | {r['total_p99_us']} | {r['trie_nodes']} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", default="8,32,128", help="comma-separated replica counts")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--trie-max-nodes", type=int, default=PolicyContext().trie_max_nodes)
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--json", default=None, help="also write the results to this file")


def run(args: argparse.Namespace) -> int:
    results = run_routing_bench(
        replica_counts=tuple(int(x) for x in args.replicas.split(",")),
        policies=tuple(x for x in args.policies.split(",") if x),
        n_requests=args.requests,
        trie_max_nodes=args.trie_max_nodes,
        prompt_tokens=args.prompt_tokens,
        chunk_tokens=args.chunk_tokens,
        seed=args.seed,
    )
    print(render_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
