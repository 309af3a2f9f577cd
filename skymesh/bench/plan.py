"""Capacity planning: the fewest replicas per region that meet an SLO over a day.

The searches here are over layouts (replicas per region); what a layout achieves comes
from an ``evaluate`` function the caller gives (``skymesh plan`` runs the discrete-event
simulator, skymesh/bench/plan_main.py). A layout *meets* the SLO when every client
region's attainment (share of its requests whose first token came within the TTFT SLO)
is at least the target, on every seed evaluated: an operator's SLO is each region's
users', not the mesh's average.

- :func:`plan_region_local`: regions that never offload are independent, so one run of a
  layout answers for every region at once; each region's count is bisected at the same
  time (doubling up from 1 until its attainment holds, then halving the gap).
- :func:`plan_shared`: a mesh that offloads (or the pooled bound) couples the regions.
  From a layout that meets the SLO (region-local's), first take one replica from every
  region at once while that still meets the SLO (strides: region-local's layout has
  slack everywhere the mesh can pool), then one replica at a time: the best-served
  region's removal is tried first and the first that meets the SLO is taken (``batch``
  of them run side by side, ahead; the plan is the same whatever the batch), until no
  single removal still meets the SLO. Then, out of that local minimum,
  one replica is moved into the binding region (the lowest attainment) from each other
  region in turn, and a removal tried from the result: a replica where load cannot leave
  may free more than one where it can (under a residency rule especially); the descent
  goes on from any such layout meeting the SLO.

Runs stop once their verdict is decided (skymesh/bench/verdict.py): region-local's
bisection asks for every region's verdict (``StopWhen.EVERY_REGION_DECIDED``), the shared
descent for the mesh's (``StopWhen.ANY_REGION_FAILS``: a layout that meets the SLO runs to
its end, so every attainment the descent orders by is exact). A stopped run's attainment
is a bound on the side of its verdict; where an exact figure of a failing layout is
needed (the shared start's worst region, the plan's reported layouts) the layout is run
whole (``stop=None``). The plan is the one the searches make without stopping.

Attainment is assumed to grow with replicas (the searches trust a bracket); the
simulator's noise can break that by a request or two near the target, so a plan is a
layout that was *measured* to meet the SLO, and the layout one replica below it was
measured not to (what the report shows for every region).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from skymesh.bench.verdict import StopWhen

# per region: its clients' SLO attainment (the lowest over the seeds evaluated)
Attainment = dict[str, float]
Layout = dict[str, int]
# layouts -> each one's attainment, in order (the caller runs them side by side), each
# run stopped as the mode says once its verdict is decided (None: run whole)
EvaluateBatch = Callable[[Sequence[Layout], StopWhen | None], list[Attainment]]


def answers(have: StopWhen | None, want: StopWhen | None) -> bool:
    """A result evaluated under ``have`` answers a question asked under ``want``: a whole
    run answers everything; every region's verdict answers the mesh's."""
    return have is None or have is want or (have is StopWhen.EVERY_REGION_DECIDED and want is not None)


def layout_key(layout: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(layout.items()))


def margin(att: Mapping[str, float], target: float) -> float:
    """How far the worst region is above the target (negative: the SLO is missed)."""
    return min(att.values()) - target


def meets(att: Mapping[str, float], target: float) -> bool:
    return margin(att, target) >= 0.0


@dataclass
class Search:
    """The layouts a search evaluated, each with its attainment, in the order run."""

    evaluate_batch: EvaluateBatch
    trials: list[tuple[Layout, Attainment]] = field(default_factory=list)
    _seen: dict[tuple[tuple[str, int], ...], tuple[Attainment, StopWhen | None]] = field(default_factory=dict)

    def run(self, layouts: Sequence[Layout], stop: StopWhen | None = None) -> list[Attainment]:
        """Each layout's attainment, evaluating only those not seen before (or seen under
        a stop that does not answer ``stop``)."""
        fresh = []
        for lay in layouts:
            k = layout_key(lay)
            seen = self._seen.get(k)
            if (seen is None or not answers(seen[1], stop)) and all(layout_key(f) != k for f in fresh):
                fresh.append(dict(lay))
        if fresh:
            for lay, att in zip(fresh, self.evaluate_batch(fresh, stop), strict=True):
                self._seen[layout_key(lay)] = (att, stop)
                self.trials.append((lay, att))
        return [self._seen[layout_key(lay)][0] for lay in layouts]


class PlanError(ValueError):
    """No layout within the bounds meets the SLO."""


def plan_region_local(search: Search, regions: Sequence[str], target: float, max_replicas: int,
                      start: Mapping[str, int] | None = None) -> Layout:
    """Each region's fewest replicas serving its own clients alone within the SLO. Each
    region's count is searched from ``start`` (default 1; skymesh/bench/plan_estimate.py
    gives an estimate) by galloping — up by 1, 2, 4, ... while it misses, down by 1, 2,
    4, ... while it meets — until a count that meets sits above one that misses, then
    bisecting between them; every region at once, one layout per step. From 1 the
    gallop up is the doubling 1, 2, 4, 8, ..."""
    lo = dict.fromkeys(regions, 0)  # the most replicas known to miss (0: none needed fewer)
    hi: dict[str, int | None] = dict.fromkeys(regions, None)  # the fewest known to meet
    probe = {r: min(max_replicas, max(1, (start or {}).get(r, 1))) for r in regions}
    step = dict.fromkeys(regions, 1)
    while True:
        att = search.run([probe], StopWhen.EVERY_REGION_DECIDED)[0]
        for r in regions:
            if hi[r] is not None and hi[r] - lo[r] <= 1:
                continue
            if att[r] >= target:
                hi[r] = probe[r]
            else:
                lo[r] = probe[r]
        open_regions = [r for r in regions if hi[r] is None or hi[r] - lo[r] > 1]
        if not open_regions:
            return _confirmed({r: int(hi[r]) for r in regions}, search, target, max_replicas)  # type: ignore[arg-type]
        for r in regions:
            h = hi[r]
            if h is None:  # misses so far: up
                nxt = min(max_replicas, probe[r] + step[r])
                if nxt == probe[r]:
                    raise PlanError(f"{r}: {max_replicas} replicas serving its own clients miss the SLO "
                                    f"(attainment {att[r]:.3f} < {target:g})")
                probe[r] = nxt
                step[r] *= 2
            elif lo[r] == 0 and h > 1 and att[r] >= target and probe[r] == h:  # meets so far: down
                probe[r] = max(1, h - step[r])
                step[r] *= 2
            elif h - lo[r] > 1:
                probe[r] = (lo[r] + h) // 2
            else:
                probe[r] = h  # settled: any count at or above it answers for this region


def _confirmed(layout: Layout, search: Search, target: float, max_replicas: int) -> Layout:
    """Region-local's answer run as one layout (each region's count was found in a run of
    its own): what the report shows is then a measured day. A region that misses in it
    (regions are independent; only the simulator's sampling differs) gets one more."""
    while True:
        att = search.run([layout])[0]  # whole: the plan's reported day
        short = [r for r in layout if att[r] < target]
        if not short:
            return layout
        for r in short:
            if layout[r] >= max_replicas:
                raise PlanError(f"{r}: {max_replicas} replicas serving its own clients miss the SLO "
                                f"(attainment {att[r]:.3f} < {target:g})")
            layout = dict(layout, **{r: layout[r] + 1})


def plan_shared(search: Search, start: Layout, target: float, max_replicas: int, min_per_region: int = 1,
                batch: int | None = None) -> Layout:
    """The fewest replicas in total, region by region, for regions that share their load
    (a mesh that offloads, or the pooled bound), descending from ``start``.

    Single removals are tried in order of the regions' attainment now (the best served
    first) and the first that meets the SLO is taken. ``batch``: how many of them are run
    side by side (None: every region's at once); it changes the runs made, never the
    plan."""
    current = dict(start)
    att = search.run([current])[0]
    # a start that misses (the shared run is not the independent one): add where it is
    # worst (exact attainments: each such start is run whole)
    while not meets(att, target):
        worst = min(current, key=lambda r: att[r])
        if current[worst] >= max_replicas:
            raise PlanError(f"{worst}: {max_replicas} replicas miss the SLO even with the other regions' help "
                            f"(attainment {att[worst]:.3f} < {target:g})")
        current[worst] += 1
        att = search.run([current])[0]
    mesh = StopWhen.ANY_REGION_FAILS
    # strides: one replica fewer in every region at once, while that still meets the SLO
    # (region-local's layout has slack in every region the mesh can pool)
    while len([r for r in current if current[r] > min_per_region]) > 1:
        stride = {r: n - 1 if n > min_per_region else n for r, n in current.items()}
        stride_att = search.run([stride], mesh)[0]
        if not meets(stride_att, target):
            break
        current, att = stride, stride_att
    while True:
        order = sorted((r for r in current if current[r] > min_per_region),
                       key=lambda r: (-att[r], -current[r], list(current).index(r)))
        candidates = [dict(current, **{r: current[r] - 1}) for r in order]
        step = len(candidates) if batch is None else max(1, batch)
        taken = None
        for lo in range(0, len(candidates), step):
            group = candidates[lo:lo + step]
            results = search.run(group, mesh)
            ok = [i for i, a in enumerate(results) if meets(a, target)]
            if ok:
                # the first in the order that meets: the same plan whatever the batch (a
                # batch only runs the next removals ahead, side by side)
                taken = (group[ok[0]], results[ok[0]])
                break
        if taken is None:
            taken = _swap_then_remove(search, current, att, target, max_replicas, min_per_region)
            if taken is None:
                return current
        current, att = taken


def _swap_then_remove(search: Search, current: Layout, att: Attainment, target: float, max_replicas: int,
                      min_per_region: int) -> tuple[Layout, Attainment] | None:
    """Out of a local minimum: move one replica into the region that binds (the lowest
    attainment: e.g. one whose clients may not leave it) from another, and take one away
    anywhere from the result. A replica where the binding region's load lives may free
    more than one elsewhere (it serves its own peak and its peers' at theirs); the
    removals alone could not find that. The first such layout meeting the SLO (fewer in
    total), or None."""
    binding = min(current, key=lambda r: (att[r], list(current).index(r)))
    if current[binding] >= max_replicas:
        return None
    donors = sorted((r for r in current if r != binding and current[r] > min_per_region),
                    key=lambda r: (-att[r], list(current).index(r)))
    for donor in donors:
        swapped = dict(current, **{donor: current[donor] - 1, binding: current[binding] + 1})
        if not meets(search.run([swapped], StopWhen.ANY_REGION_FAILS)[0], target):
            continue
        removals = [dict(swapped, **{r: swapped[r] - 1}) for r in swapped
                    if r != binding and swapped[r] > min_per_region]
        results = search.run(removals, StopWhen.ANY_REGION_FAILS)
        ok = [i for i, a in enumerate(results) if meets(a, target)]
        if ok:
            i = max(ok, key=lambda i: (margin(results[i], target), -i))
            return removals[i], results[i]
    return None
