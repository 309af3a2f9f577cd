"""Where a plan's search starts: each region's replicas estimated from its offered work
(issue 39, "fewer layouts simulated"). The simulator then only confirms and refines it
(skymesh/bench/plan.py gallops from the estimate instead of doubling up from one).

Per region, the day is cut into windows of ``window_s``; a window's work is what its
requests ask of an engine by the replicas' profile (skymesh/hardware.py):

- prefill: each request's prompt blocks not seen before in its region (the prefix cache
  the region's replicas keep between them, taken as large as the day: a lower bound on
  the prefill work) at the profile's seconds per uncached token, plus its fixed part;
- decode: each output token's share of a full decode step (``max_num_seqs`` sequences
  reading a typical context), as a replica running its full batch generates them.

The region's estimate is its busiest window's work over ``window_s × utilization`` (a
replica kept busier than that queues, and its first tokens miss the TTFT target),
rounded up. Only a start: its error costs a few more layouts, never a different rule
for what the plan is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from skymesh.bench.traces import TraceRequest
from skymesh.hardware import Profile
from skymesh.word_tokenizer import TRACE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class EstimateOptions:
    window_s: float = 60.0
    # the share of a window a replica may be busy and still answer within the SLO
    utilization: float = 0.7


def region_work_s(reqs: Sequence[TraceRequest], profile: Profile, window_s: float) -> list[float]:
    """Engine-seconds of work offered in each window of ``window_s`` (from the first
    request's arrival), prefill and decode, by ``profile``."""
    if not reqs:
        return []
    per_token, fixed = profile.ttft_seed()
    seqs = max(1, profile.max_num_seqs)
    t0 = reqs[0].arrival_s
    seen: set[int] = set()
    work: list[float] = []
    for r in reqs:
        k = int((r.arrival_s - t0) // window_s)
        while len(work) <= k:
            work.append(0.0)
        new_blocks = sum(1 for h in r.hash_ids if h not in seen)
        seen.update(r.hash_ids)
        uncached = min(r.input_len, new_blocks * TRACE_BLOCK_TOKENS)
        context = r.input_len + r.output_len // 2
        decode_per_token = profile.step_time_s(0, seqs, seqs * context) / seqs
        work[k] += fixed + per_token * uncached + decode_per_token * r.output_len
    return work


def estimate_layout(trace: Sequence[TraceRequest], regions: Sequence[str], profile: Profile, *,
                    max_replicas: int, options: EstimateOptions = EstimateOptions()) -> dict[str, int]:
    """Each region's replicas for its busiest window of ``trace`` (requests of another or
    no region count for the first region, as the simulator assigns them), within
    [1, ``max_replicas``]."""
    by_region: dict[str, list[TraceRequest]] = {r: [] for r in regions}
    for req in trace:
        by_region[req.region if req.region in by_region else regions[0]].append(req)
    out = {}
    for name, reqs in by_region.items():
        work = region_work_s(reqs, profile, options.window_s)
        peak = max(work, default=0.0)
        n = math.ceil(peak / (options.window_s * options.utilization)) if peak > 0 else 1
        out[name] = min(max_replicas, max(1, n))
    return out
