"""Goodput that can rank: found by bisection to a stated resolution, on several workload
variants (arrival seeds or trace windows), with the spread, and a ranking stated only
where every variant agrees.

Goodput of one system on one variant is the highest rate multiplier at which the SLO
attainment is ≥ the target with every lower rate the search evaluated passing too
(monotone: a lucky pass past a failure never counts). The search first brackets the
cliff (halving a failing start, doubling a passing one), then bisects until the bracket
is narrower than ``resolution`` (relative). The answer is the bracket's passing end, so it
does not depend on which fixed grid someone happened to sweep.

Pure: the simulation is the ``attainment_at`` callback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations


@dataclass(slots=True)
class GoodputSearch:
    goodput: float  # rate multiplier; 0.0 when even the smallest tried rate fails
    bracket: tuple[float, float | None]  # (passing, failing) ends; None: never failed
    evaluated: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment), in order


def bisect_goodput(attainment_at: Callable[[float], float], *, start: float = 1.0, target: float = 0.9,
                   resolution: float = 0.05, min_rate: float = 1 / 64, max_rate: float = 64.0,
                   max_evaluations: int = 20) -> GoodputSearch:
    """The monotone goodput (a rate multiplier) to within ``resolution`` × itself."""
    if not 0 < resolution < 1:
        raise ValueError("resolution must be in (0, 1)")
    evaluated: list[tuple[float, float]] = []

    def passes(rate: float) -> bool:
        att = attainment_at(rate)
        evaluated.append((rate, att))
        return att >= target

    lo: float | None = None
    hi: float | None = None
    rate = start
    if passes(rate):
        lo = rate
        while hi is None and rate * 2 <= max_rate and len(evaluated) < max_evaluations:
            rate *= 2
            if passes(rate):
                lo = rate
            else:
                hi = rate
    else:
        hi = rate
        while lo is None and rate / 2 >= min_rate and len(evaluated) < max_evaluations:
            rate /= 2
            if passes(rate):
                lo = rate
            else:
                hi = rate
    if lo is None:
        return GoodputSearch(0.0, (0.0, hi), evaluated)
    while hi is not None and (hi - lo) > resolution * lo and len(evaluated) < max_evaluations:
        mid = (lo + hi) / 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return GoodputSearch(lo, (lo, hi), evaluated)


@dataclass(frozen=True, slots=True)
class Spread:
    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)


def ranking_statements(goodputs: Mapping[str, Sequence[float]], resolution: float) -> list[str]:
    """Pairwise claims over paired variants: "A > B" only when A's goodput beats B's on
    every variant by more than the search's resolution (relative to B's); otherwise the
    pair is "not separated" (with how many variants each won)."""
    out = []
    for a, b in combinations(sorted(goodputs), 2):
        ga, gb = goodputs[a], goodputs[b]
        if len(ga) != len(gb):
            raise ValueError("every system needs the same variants")
        a_wins = sum(x > y * (1 + resolution) for x, y in zip(ga, gb, strict=True))
        b_wins = sum(y > x * (1 + resolution) for x, y in zip(ga, gb, strict=True))
        if a_wins == len(ga):
            out.append(f"{a} > {b} (every variant, by more than {resolution:.0%})")
        elif b_wins == len(gb):
            out.append(f"{b} > {a} (every variant, by more than {resolution:.0%})")
        else:
            out.append(f"{a} ~ {b}: not separated ({a} ahead in {a_wins}, {b} in {b_wins} of {len(ga)} "
                       f"variants beyond {resolution:.0%})")
    return out
