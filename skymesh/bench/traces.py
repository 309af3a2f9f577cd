"""Workload traces: the Mooncake JSONL format, scaling, sessions and regions.

A trace request has an arrival time (s), input/output lengths (tokens) and ``hash_ids``:
ids of 512-token prefix blocks (equal ids = shareable KV). For live replay every id
becomes a deterministic 512-token text block (:func:`skymesh.word_tokenizer.trace_prompt`); the
discrete-event mode hashes the ids directly.

A *session* is a prefix chain: a request continues the conversation that introduced the
deepest block it shares with earlier requests, provided it shares at least
``min_shared_blocks`` leading blocks and that block is not one where conversations part
(a system prompt several conversations start with). (In the Mooncake conversation trace
every request starts with block 0, a shared system prompt, so "same first block" would
make the whole trace one session; the deepest shared block is what identifies the
conversation.) A trace whose rows carry ``session_id`` is taken at its word.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from skymesh.word_tokenizer import TRACE_BLOCK_TOKENS

DEFAULT_TRACE_REL = "../shared/traces/mooncake_conversation.jsonl"
# the repository root's sibling `shared/`: skymesh/bench/traces.py -> parents[2] = repo root
DEFAULT_TRACE = str((Path(__file__).resolve().parents[2] / DEFAULT_TRACE_REL).resolve())


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    region: str = ""
    session: int = 0
    slo_class: str = ""  # its SLO class ("" for none)


def shared_prefix_blocks(reqs: Iterable[TraceRequest]) -> set[int]:
    """Blocks where conversations part: two or more different next blocks that later
    requests extend further. Within one conversation a block has one continued child
    (the next turn); the other children are turns' last blocks, which nothing extends
    (the next turn rewrites a partial last block). A system prompt that several
    multi-turn conversations start with has one continued child per conversation."""
    children: dict[int, set[int]] = {}
    for r in reqs:
        ids = r.hash_ids
        for a, b in zip(ids, ids[1:], strict=False):
            children.setdefault(a, set()).add(b)
    return {b for b, kids in children.items() if sum(1 for k in kids if k in children) >= 2}


def assign_sessions(reqs: Sequence[TraceRequest], min_shared_blocks: int = 2) -> list[TraceRequest]:
    """Label prefix chains (see the module docstring); ``reqs`` in arrival order. A request
    whose deepest shared block is one where conversations part
    (:func:`shared_prefix_blocks`) starts a session of its own: it shares only a common
    prefix (a system prompt), never a conversation, so two conversations are never merged
    (a conversation whose turns share nothing beyond the common prefix is split instead)."""
    owner: dict[int, int] = {}
    common = shared_prefix_blocks(reqs)
    out = []
    n = 0
    for r in reqs:
        ids = r.hash_ids
        d = 0
        while d < len(ids) and ids[d] in owner:
            d += 1
        if d >= min_shared_blocks and ids[d - 1] not in common:
            s = owner[ids[d - 1]]
        else:
            s = n
            n += 1
        for h in ids[d:]:
            owner[h] = s
        out.append(replace(r, session=s))
    return out


def load_mooncake(path: str | Path, first_n: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (``timestamp`` ms); arrivals start at 0 s.

    A row may carry its own ``region`` (a region name), ``session_id`` (any JSON scalar)
    and ``slo_class`` (a class name): all are kept as they are. Sessions are inferred from the prefix chains
    (:func:`assign_sessions`) only when no row names one."""
    rows: list[TraceRequest] = []
    session_ids: dict[object, int] = {}
    named_sessions = 0
    t0: float | None = None
    with open(path) as f:
        for i, line in enumerate(f):
            if first_n is not None and i >= first_n:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            ts = float(row["timestamp"]) / 1000.0
            t0 = ts if t0 is None else t0
            ids = tuple(int(h) for h in row.get("hash_ids", ()))
            session = 0
            if row.get("session_id") is not None:
                named_sessions += 1
                session = session_ids.setdefault(row["session_id"], len(session_ids))
            rows.append(TraceRequest(ts - t0, int(row["input_length"]), int(row["output_length"]), ids,
                                     region=str(row.get("region") or ""), session=session,
                                     slo_class=str(row.get("slo_class") or "")))
    rows.sort(key=lambda r: r.arrival_s)
    if named_sessions and named_sessions != len(rows):
        raise ValueError(f"{path}: {named_sessions} of {len(rows)} rows name a session_id: all or none must")
    return rows if named_sessions else assign_sessions(rows)


def assign_slo_classes(reqs: Sequence[TraceRequest], shares: Mapping[str, float], seed: int = 0
                       ) -> list[TraceRequest]:
    """Give every session one SLO class, drawn with the given ``shares`` (class name ->
    weight) by a generator seeded with ``seed``: a conversation keeps its class across its
    turns, as a client (a chat app, a code assistant, a batch job) does. Sessions are
    drawn in order of first appearance, so the same trace and seed give the same classes."""
    names = [n for n, w in shares.items() if w > 0]
    if not names:
        raise ValueError("an SLO class mix needs at least one class with a positive share")
    weights = [shares[n] for n in names]
    rng = random.Random(seed)
    of_session: dict[int, str] = {}
    out = []
    for r in reqs:
        cls = of_session.get(r.session)
        if cls is None:
            cls = of_session[r.session] = rng.choices(names, weights)[0]
        out.append(replace(r, slo_class=cls))
    return out


def fit_request(r: TraceRequest, max_model_len: int, kv_tokens: int) -> TraceRequest:
    """Cut a prompt that cannot run on the replica: input + output within the model's
    context, the input within half the KV cache (the trace was recorded on a larger model).
    A real vLLM rejects such a prompt with HTTP 400, which would count as an SLO miss for
    every system alike; the live and discrete-event modes both cut it this way instead, so
    they replay the same work."""
    output_len = max(1, r.output_len)
    input_len = max(1, min(r.input_len, max_model_len - output_len, kv_tokens // 2))
    if input_len == r.input_len and output_len == r.output_len:
        return r
    blocks = -(-input_len // TRACE_BLOCK_TOKENS)
    return replace(r, input_len=input_len, output_len=output_len, hash_ids=r.hash_ids[:blocks])


def fit_to_context(reqs: Sequence[TraceRequest], max_model_len: int, kv_tokens: int) -> list[TraceRequest]:
    return [fit_request(r, max_model_len, kv_tokens) for r in reqs]


def scale_rate(reqs: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Multiply the arrival rate by ``factor`` (inter-arrival times divided by it)."""
    if factor <= 0:
        raise ValueError("rate factor must be > 0")
    return [replace(r, arrival_s=r.arrival_s / factor) for r in reqs]


def scale_time(reqs: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Stretch the time axis by ``factor`` (0.1 = replay ten times faster)."""
    return scale_rate(reqs, 1.0 / factor)


def window(reqs: Sequence[TraceRequest], start_s: float, duration_s: float) -> list[TraceRequest]:
    """Requests arriving in [start, start + duration), re-based to start at 0."""
    sel = [r for r in reqs if start_s <= r.arrival_s < start_s + duration_s]
    return [replace(r, arrival_s=r.arrival_s - start_s) for r in sel]


def region_weights(n: int, skew: float) -> list[float]:
    """Session shares per region: ``skew`` in [0, 1) moves that fraction of the non-first
    regions' uniform share onto the first region (0 = uniform)."""
    if n <= 1:
        return [1.0]
    if not 0.0 <= skew < 1.0:
        raise ValueError("skew must be in [0, 1)")
    first = 1.0 / n + skew * (1.0 - 1.0 / n)
    return [first] + [(1.0 - first) / (n - 1)] * (n - 1)


def assign_regions(reqs: Sequence[TraceRequest], regions: Sequence[str], skew: float = 0.0,
                   seed: int = 0, weights: Sequence[float] | None = None) -> list[TraceRequest]:
    """Each session (prefix chain) is assigned to one region, drawn by ``weights`` (one per
    region; default :func:`region_weights` of ``skew``); a request that names its own
    region (one of ``regions``) keeps it."""
    rng = random.Random(seed)
    weights = list(weights) if weights is not None else region_weights(len(regions), skew)
    by_session: dict[int, str] = {}
    out = []
    known = set(regions)
    for r in reqs:
        if r.region:
            if r.region not in known:
                raise ValueError(f"trace request names region {r.region!r}, not one of {', '.join(regions)}")
            out.append(r)
            continue
        reg = by_session.get(r.session)
        if reg is None:
            reg = by_session[r.session] = rng.choices(list(regions), weights)[0]
        out.append(replace(r, region=reg))
    return out


def diurnal_factor(t_s: float, period_s: float, phase: float, amplitude: float) -> float:
    """The relative rate (peak 1.0, trough 1 - amplitude) at ``t_s`` of a region whose peak
    is shifted by ``phase`` (fraction of a period: its time zone)."""
    return (1.0 - amplitude) + amplitude * (0.5 + 0.5 * math.cos(2 * math.pi * (t_s / period_s - phase)))


def diurnal(reqs: Sequence[TraceRequest], regions: Sequence[str], period_s: float,
            amplitude: float | Sequence[float] = 0.8, seed: int = 0,
            phases: Sequence[float] | None = None) -> list[TraceRequest]:
    """Per-region diurnal load: sessions keep their region and each region's arrivals are
    thinned by its own rate curve. ``amplitude`` is one for every region or one per region;
    ``phases`` (fractions of a period) default to time zones spread evenly: region k peaks
    ``k / len(regions)`` of a period after region 0. The thinning's random stream is its
    own: seeded with ``seed`` alone it drew what :func:`assign_regions` had drawn with the
    same seed, so a new session's first request was dropped exactly when its region was
    late in ``regions`` (with 3 even regions, every first request of the last region's
    sessions at its trough)."""
    rng = random.Random(f"diurnal:{seed}")
    ph = list(phases) if phases is not None else [k / len(regions) for k in range(len(regions))]
    amp = [float(amplitude)] * len(regions) if isinstance(amplitude, (int, float)) else list(amplitude)
    index = {name: k for k, name in enumerate(regions)}
    out = []
    for r in reqs:
        k = index.get(r.region, 0)
        if rng.random() < diurnal_factor(r.arrival_s, period_s, ph[k], amp[k]):
            out.append(r)
    return out


def oracle_hit_rate(reqs: Iterable[TraceRequest]) -> float:
    """Token-weighted share of prompt tokens an infinite cache shared by all replicas would
    hit: whole 512-token blocks seen before (a request's last, partial block counted with
    its real length), as vLLM counts prefix-cache hits in tokens."""
    seen: set[int] = set()
    hits = total = 0
    for r in reqs:
        for i, h in enumerate(r.hash_ids):
            n = min(TRACE_BLOCK_TOKENS, max(0, r.input_len - i * TRACE_BLOCK_TOKENS))
            total += n
            if h in seen:
                hits += n
            else:
                seen.add(h)
    return hits / total if total else 0.0


def lru_hit_rate(reqs: Iterable[TraceRequest], capacity_tokens: int) -> float:
    """The realistic bound on prefix hits: token-weighted hit rate of one LRU cache of
    ``capacity_tokens`` (the cluster's total KV) shared by every replica, in arrival order.

    Like vLLM's prefix cache, a request hits only a contiguous prefix of cached blocks;
    its blocks are then the most recently used, the first one last to go (vLLM frees a
    finished request's blocks tail first). No routing can beat a shared cache of the same
    size that never splits a prefix across replicas; the infinite-cache oracle
    (:func:`oracle_hit_rate`) overstates what is reachable once the caches evict. Running
    requests' blocks are not held apart from the cache here, so the bound is loose by
    that much."""
    from collections import OrderedDict

    capacity = max(0, capacity_tokens // TRACE_BLOCK_TOKENS)
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for r in reqs:
        prefix = True
        for i, h in enumerate(r.hash_ids):
            n = min(TRACE_BLOCK_TOKENS, max(0, r.input_len - i * TRACE_BLOCK_TOKENS))
            total += n
            if prefix and h in cache:
                hits += n
            else:
                prefix = False
        for h in reversed(r.hash_ids):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / total if total else 0.0
