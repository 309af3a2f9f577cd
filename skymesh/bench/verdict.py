"""Stop a simulated day once its SLO verdict is decided (issue 39).

A run judged against an SLO attainment target (each client region's share of its
requests served within the TTFT target, and the TBT target when one is given, at least
``target``; skymesh/bench/scores.py) often has a plain verdict long before its last
request: an overloaded layout misses more requests in its first minutes than the target
allows over the whole day. :class:`VerdictWatch` counts, per client region, the requests
whose outcome is already certain — met (first token within the TTFT target; with a TBT
target, finished within it too) or missed (a first token past it, or none yet when the
target has passed — the simulator sweeps for those every sampling interval —, a TBT past
its target, a rejection) — and says when the verdict can no longer change:

- a region *fails* for certain when even every request of it still open meeting the SLO
  would leave its attainment under the target;
- a region *passes* for certain when the requests already met reach the target.

The bounds are computed exactly as :func:`~skymesh.bench.scores.summarize_arrays`
computes attainment (the same counted requests after the warm-up, the same rounding),
so a decided verdict is the verdict the full run would give. Modes (:class:`StopWhen`):
``any_region_fails`` ends the run at the first region that fails (a mesh's verdict:
it meets the SLO only if every region does); ``every_region_decided`` ends it when each
region's own verdict is known (region-local planning bisects each region from one run).
A run that passes is always run to its end in the first mode, so its figures are exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum

import numpy as np


class StopWhen(Enum):
    ANY_REGION_FAILS = "any_region_fails"
    EVERY_REGION_DECIDED = "every_region_decided"


def attainment(met: int, n: int) -> float:
    """Attainment as the scores compute it (skymesh/bench/scores.py)."""
    return round(met / n, 4) if n else 0.0


class VerdictWatch:
    """Per client region, the counted requests whose SLO outcome is certain, and whether
    the run's verdict is decided (``decided``, with ``reason``)."""

    def __init__(self, regions: Sequence[str], region_of: np.ndarray, counted: np.ndarray, *, slo_s: float,
                 target: float, when: StopWhen, tbt_slo_s: float | None = None) -> None:
        self.regions = tuple(regions)
        self.region_of = region_of.astype(np.int64)
        self.counted = counted.astype(bool)
        self.slo_s = slo_s
        self.tbt_slo_s = tbt_slo_s
        self.target = target
        self.when = when
        k = len(self.regions)
        self.total = np.bincount(self.region_of[self.counted], minlength=k).astype(np.int64)
        self.met = np.zeros(k, dtype=np.int64)
        self.missed = np.zeros(k, dtype=np.int64)
        # 0: open, 1: met, 2: missed (a request is counted once)
        self._outcome = bytearray(len(self.region_of))
        self.decided = False
        self.reason = ""
        # a region with no request to judge has attainment 0 (as the scores give it)
        empty = [name for k, name in enumerate(self.regions) if self.total[k] == 0]
        if empty and target > 0 and (when is StopWhen.ANY_REGION_FAILS or len(empty) == k):
            self._decide(f"no request of {', '.join(empty)} to judge: attainment 0 < {target:g}")

    @classmethod
    def for_requests(cls, regions: Sequence[str], arrival: Sequence[float], client_region: Sequence[str], *,
                     slo_s: float, target: float, when: StopWhen, warmup_s: float = 0.0,
                     tbt_slo_s: float | None = None) -> VerdictWatch:
        """The watch of a day whose requests (in the simulator's order, by index) arrive at
        ``arrival`` from ``client_region``: a region's requests count from its own first
        arrival plus ``warmup_s``, as the region summaries count them."""
        index = {name: k for k, name in enumerate(regions)}
        region_of = np.array([index[r] for r in client_region], dtype=np.int64)
        arr = np.asarray(arrival, dtype=float)
        counted = np.zeros(arr.size, dtype=bool)
        for k in range(len(regions)):
            sel = region_of == k
            if sel.any():
                counted[sel] = arr[sel] >= arr[sel].min() + warmup_s
        return cls(regions, region_of, counted, slo_s=slo_s, target=target, when=when, tbt_slo_s=tbt_slo_s)

    # ------------------------------------------------------------------ outcomes

    def first_token(self, i: int, ttft_s: float) -> bool:
        """Request ``i``'s first token came ``ttft_s`` after its arrival. True: decided."""
        if ttft_s > self.slo_s:
            return self._settle(i, missed=True)
        if self.tbt_slo_s is None:
            return self._settle(i, missed=False)
        return self.decided  # met or not is known at its end (its TBT)

    def finished(self, i: int, tbt_s: float) -> bool:
        """Request ``i`` ended with TBT ``tbt_s`` (judged only with a TBT target)."""
        if self.tbt_slo_s is None:
            return self.decided
        return self._settle(i, missed=not tbt_s <= self.tbt_slo_s)

    def rejected(self, i: int) -> bool:
        return self._settle(i, missed=True)

    def overdue(self, i: int) -> bool:
        """Request ``i`` has no first token yet and its TTFT target has passed: a miss."""
        return self._settle(i, missed=True)

    def _settle(self, i: int, *, missed: bool) -> bool:
        if not self.counted[i] or self._outcome[i]:
            return self.decided
        self._outcome[i] = 2 if missed else 1
        k = int(self.region_of[i])
        if missed:
            self.missed[k] += 1
            if self.decided:
                return True
            if self.fails(k):
                if self.when is StopWhen.ANY_REGION_FAILS:
                    self._decide(f"{self.regions[k]} missed {self.missed[k]} of {self.total[k]} requests: "
                                 f"attainment at most {self.upper(k):.4f} < {self.target:g}")
                elif all(self.verdict(j) is not None for j in range(len(self.regions))):
                    self._decide("every region's verdict is decided")
        else:
            self.met[k] += 1
            if (not self.decided and self.when is StopWhen.EVERY_REGION_DECIDED and self.passes(k)
                    and all(self.verdict(j) is not None for j in range(len(self.regions)))):
                self._decide("every region's verdict is decided")
        return self.decided

    def _decide(self, reason: str) -> None:
        self.decided = True
        self.reason = reason

    # ------------------------------------------------------------------ bounds

    def upper(self, k: int) -> float:
        """Region ``k``'s attainment if every request of it still open meets the SLO."""
        return attainment(int(self.total[k] - self.missed[k]), int(self.total[k]))

    def lower(self, k: int) -> float:
        """Region ``k``'s attainment if every request of it still open misses."""
        return attainment(int(self.met[k]), int(self.total[k]))

    def fails(self, k: int) -> bool:
        return self.upper(k) < self.target

    def passes(self, k: int) -> bool:
        return self.lower(k) >= self.target

    def verdict(self, k: int) -> bool | None:
        """Region ``k`` meets the target (True), misses it (False), or not yet known."""
        if self.passes(k):
            return True
        if self.fails(k):
            return False
        return None

    def bounds(self) -> Mapping[str, tuple[float, float]]:
        """Per region, the attainment's (lowest, highest) still possible."""
        return {name: (self.lower(k), self.upper(k)) for k, name in enumerate(self.regions)}
