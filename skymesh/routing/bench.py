"""Routing decision-time micro-benchmark (`skymesh bench routing`).

Each policy first gets its prefix trie filled to its bound with realistic prompts (a few
shared system prompts + unique conversations, ~2k tokens, 64-token chunks); then every
measured request is one ``choose`` + ``on_dispatch`` with the same views a balancer would
pass (all replicas, some unavailable). Times come from perf_counter_ns around the two
calls only; prompt hashing is done before (the balancer does it once at admission).
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


def _requests(n: int, rng: random.Random, chunk_tokens: int, prompt_tokens: int) -> list[RoutingRequest]:
    systems = [[f"sys{s}w{i}" for i in range(rng.choice((256, 512, 1024)))] for s in range(8)]
    out = []
    for i in range(n):
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


def run_routing_bench(
    replica_counts: tuple[int, ...] = (8, 32, 128),
    policies: tuple[str, ...] = tuple(POLICIES),
    n_requests: int = 5000,
    trie_max_nodes: int = 50_000,
    prompt_tokens: int = 2048,
    seed: int = 0,
) -> dict[str, Any]:
    from skymesh.gc_tuning import tune_gc

    tune_gc()  # the same collector settings the balancer daemon runs with
    ctx = PolicyContext(chunk_tokens=64, trie_max_nodes=trie_max_nodes, seed=seed)
    results: dict[str, Any] = {}
    for n_rep in replica_counts:
        ids = [f"r{i}" for i in range(n_rep)]
        for name in policies:
            rng = random.Random(seed)
            policy = make_policy(name, ctx)
            policy.set_replicas(ids)
            views = {rid: ReplicaView(rid, pending_prefill_tokens=rng.randrange(4096)) for rid in ids}
            # fill the trie to its bound (unique conversations evict each other)
            fill = _requests(trie_max_nodes // (prompt_tokens // 64) + 200, rng, 64, prompt_tokens)
            for i, r in enumerate(fill):
                policy.on_dispatch(r, ids[i % n_rep], r.arrival)
            reqs = _requests(n_requests, rng, 64, prompt_tokens)
            samples: list[float] = []
            book: list[float] = []
            now = 10.0
            for r in reqs:
                # a quarter of the replicas busy, varying per request
                for v in views.values():
                    v.available = rng.random() > 0.25
                views[ids[0]].available = True  # the balancer only asks when one is free
                now += 1e-3
                r.arrival = now - 5.0  # waited long: DualMap places instead of holding
                t0 = time.perf_counter_ns()
                d = policy.choose(r, views, now)
                t1 = time.perf_counter_ns()
                if d.replica_id is not None:
                    policy.on_dispatch(r, d.replica_id, now)
                t2 = time.perf_counter_ns()
                samples.append((t1 - t0) / 1000.0)
                book.append((t2 - t1) / 1000.0)
                if d.replica_id is not None:
                    policy.on_complete(r, d.replica_id, True, now)
            samples.sort()
            book.sort()
            stats = getattr(policy, "trie", None)
            results[f"{name}@{n_rep}"] = {
                "policy": name,
                "replicas": n_rep,
                "p50_us": round(_percentile(samples, 0.50), 2),
                "p99_us": round(_percentile(samples, 0.99), 2),
                "mean_us": round(sum(samples) / len(samples), 2),
                "dispatch_p50_us": round(_percentile(book, 0.50), 2),
                "dispatch_p99_us": round(_percentile(book, 0.99), 2),
                "trie_nodes": len(stats) if stats is not None else 0,
            }
    return results


def render_table(results: dict[str, Any]) -> str:
    lines = [
        "| policy | replicas | decision p50 µs | decision p99 µs | bookkeeping p50 µs | bookkeeping p99 µs | trie nodes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        lines.append(
            f"| {r['policy']} | {r['replicas']} | {r['p50_us']} | {r['p99_us']} | {r['dispatch_p50_us']} "
            f"| {r['dispatch_p99_us']} | {r['trie_nodes']} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", default="8,32,128", help="comma-separated replica counts")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--trie-max-nodes", type=int, default=50_000)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--json", default=None, help="also write the results to this file")


def run(args: argparse.Namespace) -> int:
    results = run_routing_bench(
        replica_counts=tuple(int(x) for x in args.replicas.split(",")),
        policies=tuple(x for x in args.policies.split(",") if x),
        n_requests=args.requests,
        trie_max_nodes=args.trie_max_nodes,
        prompt_tokens=args.prompt_tokens,
    )
    print(render_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
