"""The shape of a simulated day over several regions: how a trace's sessions are shared
among the regions and how each region's arrivals swing over the day.

One place for the options ``skymesh sim``, ``skymesh bench`` (live, 3 regions) and
``skymesh plan`` take, so a day named in docs/benchmarks.md replays the same in each:

- ``--skew`` or ``--region-weights``: the sessions' (prefix chains') shares per region;
- ``--diurnal-period-s``: the period of every region's rate curve (0: no curve);
- ``--amplitude``: one value for every region or one per region (trough = 1 - amplitude);
- ``--phases``: each region's peak as a fraction of the period after the curve's start
  (its time zone); default evenly spread, region k at ``k / regions``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from skymesh.bench.traces import TraceRequest, assign_regions, diurnal, region_weights


@dataclass(frozen=True)
class DayShape:
    """Session shares per region, and each region's diurnal curve (period 0: flat)."""

    weights: tuple[float, ...]
    period_s: float = 0.0
    amplitudes: tuple[float, ...] = ()
    phases: tuple[float, ...] = ()

    def apply(self, reqs: Sequence[TraceRequest], regions: Sequence[str], seed: int) -> list[TraceRequest]:
        """Sessions to ``regions`` by the weights, then each region's arrivals thinned by its
        curve (seeded: the same seed draws the same regions and the same thinning)."""
        out = assign_regions(reqs, regions, seed=seed, weights=self.weights)
        if self.period_s > 0:
            out = diurnal(out, regions, self.period_s, list(self.amplitudes), seed=seed, phases=self.phases)
        return out

    def describe(self) -> dict[str, object]:
        return {"region_weights": [round(w, 4) for w in self.weights], "diurnal_period_s": self.period_s,
                "amplitudes": list(self.amplitudes), "phases": list(self.phases)}


def _floats(text: str, option: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{option}: comma-separated numbers, got {text!r}") from None


def add_day_arguments(p: argparse.ArgumentParser, first_region: str = "the first region") -> None:
    p.add_argument("--skew", type=float, default=0.0,
                   help=f"extra share of sessions in {first_region} [0, 1) (0: even)")
    p.add_argument("--region-weights", default=None, metavar="W,W,...",
                   help="sessions' share per region, in region order (normalised; instead of --skew)")
    p.add_argument("--diurnal-period-s", type=float, default=0.0, help="per-region diurnal curve period (0: off)")
    p.add_argument("--amplitude", default="0.8", metavar="A[,A,...]",
                   help="diurnal trough = 1 - amplitude of the peak: one value, or one per region")
    p.add_argument("--phases", default=None, metavar="P,P,...",
                   help="each region's peak as a fraction of the period (default: region k at k / regions)")


def day_shape(args: argparse.Namespace, n_regions: int) -> DayShape:
    """The day the options describe for ``n_regions`` regions (a SystemExit naming the
    option that does not fit)."""
    if args.region_weights is not None:
        if args.skew:
            raise SystemExit("--region-weights and --skew: give one of them")
        weights = _floats(args.region_weights, "--region-weights")
        if len(weights) != n_regions or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise SystemExit(f"--region-weights: {n_regions} non-negative numbers with a positive sum")
        total = sum(weights)
        weights = [w / total for w in weights]
    else:
        try:
            weights = region_weights(n_regions, args.skew)
        except ValueError as e:
            raise SystemExit(f"--skew: {e}") from None
    amplitudes = _floats(str(args.amplitude), "--amplitude")
    if len(amplitudes) == 1:
        amplitudes *= n_regions
    if len(amplitudes) != n_regions or not all(0.0 <= a <= 1.0 for a in amplitudes):
        raise SystemExit(f"--amplitude: one value or {n_regions}, each in [0, 1]")
    if args.phases is not None:
        phases = _floats(args.phases, "--phases")
        if len(phases) != n_regions:
            raise SystemExit(f"--phases: {n_regions} fractions of the period, one per region")
    else:
        phases = [k / n_regions for k in range(n_regions)]
    if args.diurnal_period_s < 0:
        raise SystemExit("--diurnal-period-s: 0 (off) or a positive period")
    return DayShape(tuple(weights), args.diurnal_period_s, tuple(amplitudes), tuple(phases))
