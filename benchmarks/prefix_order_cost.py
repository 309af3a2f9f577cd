"""The ``prefix`` (FEATHER) discipline's cost per dispatch decision, against the FCFS order
measured in the same run.

    .venv/bin/python -m benchmarks.prefix_order_cost [--decisions 2000]

A queue of Q requests (tool/agent-like: 16 system prompts of 8 chunks, 2-6 chunks of user
text each) in front of R replicas; each decision frees one slot on every replica, takes the
order, places the first R requests (the dispatcher's ``on_dequeued`` + ``on_dispatch``) and
queues R new ones, so the queue stays at Q. Timed with ``perf_counter_ns`` around
``dispatch_order`` (the decision) and around one request's ``on_queued`` + ``on_dispatch``
(the bookkeeping); FCFS's decision is ``PriorityQueue.ids()``, what the dispatcher walks
without a discipline.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.routing.base import RoutingRequest  # noqa: E402
from skymesh.routing.disciplines.prefix_match import PrefixMatchOrder  # noqa: E402
from skymesh.routing.hashing import cumulative_hashes  # noqa: E402
from skymesh.routing.model import RegionModel  # noqa: E402
from skymesh.routing.queueing import PriorityQueue  # noqa: E402

CHUNK = 64


def request(rng: random.Random, n: int, now: float) -> RoutingRequest:
    system = rng.randrange(16)
    parts = [f"s{system}-{k}" for k in range(8)] + [f"u{n}-{k}" for k in range(rng.randint(2, 6))]
    return RoutingRequest(f"q{n}", cumulative_hashes(p.encode() for p in parts), len(parts) * CHUNK + 17, now)


def pct(xs: list[int], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] / 1000.0


def run(queue_len: int, replicas: int, decisions: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    names = [f"r{i}" for i in range(replicas)]
    order = PrefixMatchOrder(model=RegionModel(chunk_tokens=CHUNK), max_age_s=1e9)
    order.set_replicas(names)
    queue: PriorityQueue[str] = PriorityQueue()
    waiting: dict[str, RoutingRequest] = {}
    n = 0
    book: list[int] = []

    def add(now: float) -> None:
        nonlocal n
        n += 1
        r = request(rng, n, now)
        queue.push(r.request_id, r.request_id)
        t0 = time.perf_counter_ns()
        order.on_queued(r)
        book.append(time.perf_counter_ns() - t0)
        waiting[r.request_id] = r

    for _ in range(queue_len):
        add(0.0)
    slots = dict.fromkeys(names, 1)
    feather: list[int] = []
    fcfs: list[int] = []
    gc.freeze()
    for d in range(decisions):
        now = 1.0 + d * 0.01
        t0 = time.perf_counter_ns()
        ids = queue.ids()
        fcfs.append(time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        got = order.dispatch_order(queue, {}, slots, now)
        feather.append(time.perf_counter_ns() - t0)
        assert len(got) == len(ids)
        for k, rid in enumerate(got[:replicas]):
            queue.pop(rid)
            t0 = time.perf_counter_ns()
            order.on_dequeued(rid)
            order.on_dispatch(waiting.pop(rid), names[k % replicas], now)
            book[-1 - k % len(book)] += time.perf_counter_ns() - t0
        for _ in range(replicas):
            add(now)
    gc.unfreeze()
    return {"feather_p50_us": pct(feather, 0.5), "feather_p99_us": pct(feather, 0.99),
            "fcfs_p50_us": pct(fcfs, 0.5), "ratio_p50": statistics.median(feather) / max(1, statistics.median(fcfs)),
            "per_request_p50_us": pct(book, 0.5), "per_request_p99_us": pct(book, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=2000)
    cli = ap.parse_args()
    print("| queue | replicas | decision p50 µs | p99 µs | fcfs p50 µs | ratio (p50) | per request p50 µs | p99 µs |")
    print("|---|---|---|---|---|---|---|---|")
    for queue_len, replicas in ((64, 8), (256, 8), (256, 32), (1024, 32), (1024, 128)):
        r = run(queue_len, replicas, max(50, cli.decisions * 8 // replicas))
        print(f"| {queue_len} | {replicas} | {r['feather_p50_us']:.0f} | {r['feather_p99_us']:.0f} | "
              f"{r['fcfs_p50_us']:.1f} | {r['ratio_p50']:.0f}x | {r['per_request_p50_us']:.0f} | "
              f"{r['per_request_p99_us']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
