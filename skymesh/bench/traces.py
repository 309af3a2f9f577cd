"""Workload traces: the Mooncake JSONL format and synthetic generators.

A trace request has an arrival time (s), input/output lengths (tokens) and ``hash_ids``:
ids of 512-token prefix blocks (equal ids = shareable KV). A *session* is a prefix chain:
requests whose first block id is equal belong to the same conversation.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from skymesh.tokens import TRACE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    region: str = ""
    session: int = 0

    @property
    def prefix_key(self) -> int:
        return self.hash_ids[0] if self.hash_ids else -1


def load_mooncake(path: str | Path, first_n: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    t0: float | None = None
    with open(path) as f:
        for i, line in enumerate(f):
            if first_n is not None and i >= first_n:
                break
            row = json.loads(line)
            ts = float(row["timestamp"]) / 1000.0
            t0 = ts if t0 is None else t0
            ids = tuple(int(h) for h in row.get("hash_ids", ()))
            out.append(TraceRequest(ts - t0, int(row["input_length"]), int(row["output_length"]), ids,
                                    session=ids[0] if ids else i))
    return out


def scale_rate(reqs: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Multiply the arrival rate (divide inter-arrival times) by ``factor``."""
    return [replace(r, arrival_s=r.arrival_s / factor) for r in reqs]


def window(reqs: Sequence[TraceRequest], start_s: float, duration_s: float) -> list[TraceRequest]:
    sel = [r for r in reqs if start_s <= r.arrival_s < start_s + duration_s]
    return [replace(r, arrival_s=r.arrival_s - start_s) for r in sel]


def assign_regions(reqs: Sequence[TraceRequest], regions: Sequence[str], skew: float = 0.0,
                   seed: int = 0) -> list[TraceRequest]:
    """Sessions (prefix chains) are assigned to regions; ``skew`` in [0, 1) puts that extra
    share of sessions on the first region (0 = uniform)."""
    rng = random.Random(seed)
    weights = [1.0 / len(regions)] * len(regions)
    if len(regions) > 1 and skew > 0:
        weights = [1.0 / len(regions) + skew * (1 - 1.0 / len(regions))] + [
            (1 - (1.0 / len(regions) + skew * (1 - 1.0 / len(regions)))) / (len(regions) - 1)
        ] * (len(regions) - 1)
    by_session: dict[int, str] = {}
    out = []
    for r in reqs:
        reg = by_session.get(r.session)
        if reg is None:
            reg = by_session[r.session] = rng.choices(regions, weights)[0]
        out.append(replace(r, region=reg))
    return out


def diurnal(reqs: Sequence[TraceRequest], regions: Sequence[str], period_s: float, amplitude: float = 0.8,
            seed: int = 0) -> list[TraceRequest]:
    """Per-region diurnal load: sessions keep their region, and each region's traffic is
    thinned by a sinusoid whose peak is shifted by its time zone (1/len(regions) of a
    period apart), so regions peak at different times."""
    rng = random.Random(seed)
    out = []
    for r in reqs:
        k = regions.index(r.region) if r.region in regions else 0
        phase = 2 * math.pi * (r.arrival_s / period_s - k / len(regions))
        keep = (1 - amplitude) + amplitude * (0.5 + 0.5 * math.cos(phase))
        if rng.random() < keep:
            out.append(r)
    return out


def hot_prefix_workload(n: int, rate_per_s: float, n_prompts: int = 4, prompt_blocks: int = 4,
                        hot_share: float = 0.8, user_blocks: int = 2, output_len: int = 128,
                        seed: int = 0) -> list[TraceRequest]:
    """Tool/agent traffic: a few very popular system prompts (``hot_share`` of requests on
    ``n_prompts`` prompts, Zipf-like), each request with its own user part."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(n_prompts)]
    t = 0.0
    out = []
    next_id = 10_000_000
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        if rng.random() < hot_share:
            p = rng.choices(range(n_prompts), weights)[0]
            sys_ids = tuple(1_000_000 + p * 1000 + b for b in range(prompt_blocks))
        else:
            sys_ids = tuple(range(next_id, next_id + prompt_blocks))
            next_id += prompt_blocks
        user = tuple(range(next_id, next_id + user_blocks))
        next_id += user_blocks
        ids = sys_ids + user
        out.append(TraceRequest(t, len(ids) * TRACE_BLOCK_TOKENS, output_len, ids, session=ids[0]))
    return out


def tree_of_thoughts(n_trees: int, branching: int, depth: int, rate_per_s: float, root_blocks: int = 4,
                     step_blocks: int = 1, output_len: int = 64, seed: int = 0) -> list[TraceRequest]:
    """Tree-of-Thoughts: each node's prompt = its parent's prompt + one step; all nodes of a
    tree share the root prefix, siblings share their parent's."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    next_id = 50_000_000
    t = 0.0
    for _ in range(n_trees):
        t += rng.expovariate(rate_per_s)
        root = tuple(range(next_id, next_id + root_blocks))
        next_id += root_blocks
        frontier = [root]
        level_t = t
        for _level in range(depth):
            nxt = []
            for node in frontier:
                for _b in range(branching):
                    ids = node + tuple(range(next_id, next_id + step_blocks))
                    next_id += step_blocks
                    out.append(TraceRequest(level_t, len(ids) * TRACE_BLOCK_TOKENS, output_len, ids,
                                            session=root[0]))
                    nxt.append(ids)
            frontier = nxt
            level_t += 2.0  # the next level waits for the previous level's answers
    out.sort(key=lambda r: r.arrival_s)
    return out


def oracle_hit_rate(reqs: Iterable[TraceRequest]) -> float:
    """Share of prompt blocks an infinite cache shared by everyone would hit."""
    seen: set[int] = set()
    hits = total = 0
    for r in reqs:
        for h in r.hash_ids:
            total += 1
            if h in seen:
                hits += 1
            else:
                seen.add(h)
    return hits / total if total else 0.0
