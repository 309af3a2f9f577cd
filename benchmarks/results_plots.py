"""Redraw every figure of docs/results.md from the results JSON committed beside it
(docs/data/), each through its own benchmark command's ``--replot``: a rerun of a
benchmark that writes its JSON there refreshes its figure the same way.

    PYTHONPATH=. .venv/bin/python -m benchmarks.results_plots [--data docs/data] [--img docs/img]

A figure whose JSON is not there is named with the command that makes it, and skipped.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import fleet_capacity, pd_split, slo_mix, three_days
from skymesh.bench import live

PD_SYSTEMS = ("aggregated,always@2:6,always@3:5,always@4:4,always@5:3,always@6:2,always@7:1,threshold@5:3,"
              "conductor@6:2,conductor@2:2,conductor@0:0,elastic@0:0")


def _live_replot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="skymesh bench")
    live.add_arguments(p)
    return live.run(p.parse_args(argv))


@dataclass(frozen=True)
class Figure:
    png: str
    data: tuple[str, ...]  # the JSON files under --data, in the order --replot takes them
    replot: Callable[[list[str]], int]  # the command's entry point, given its --replot arguments
    command: str  # how it is run from a shell, {data} and {png} filled in
    extra: tuple[str, ...] = ()  # further arguments of the replot

    def argv(self, data: Path, png: Path) -> list[str]:
        return ["--replot", *(str(data / name) for name in self.data), "--png", str(png), *self.extra]


FIGURES: tuple[Figure, ...] = (
    Figure("peers.png", ("peers.json",), _live_replot,
           ".venv/bin/skymesh bench --replot {data} --png {png}"),
    Figure("geo_days.png", ("three_days.json",), three_days.main,
           "PYTHONPATH=. .venv/bin/python -m benchmarks.three_days --replot {data} --png {png}"),
    Figure("fleet.png", ("fleet_capacity.json",), fleet_capacity.main,
           "PYTHONPATH=. .venv/bin/python -m benchmarks.fleet_capacity --replot {data} --png {png}"),
    Figure("slo_mix.png", ("slo_mix.json",), slo_mix.main,
           "PYTHONPATH=. .venv/bin/python -m benchmarks.slo_mix --replot {data} --png {png}"),
    Figure("pd_split.png", ("pd_split.json", "pd_split_7.json", "pd_conductor.json", "pd_elastic.json"), pd_split.main,
           "PYTHONPATH=. .venv/bin/python -m benchmarks.pd_split --replot {data} --png {png} --systems " + PD_SYSTEMS,
           ("--systems", PD_SYSTEMS)),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="docs/data", help="the committed results JSON")
    p.add_argument("--img", default="docs/img", help="where the PNGs go")
    args = p.parse_args(argv)
    data, img = Path(args.data), Path(args.img)
    missing = 0
    for fig in FIGURES:
        absent = [name for name in fig.data if not (data / name).is_file()]
        if absent:
            missing += 1
            print(f"skipped {img / fig.png}: no {', '.join(str(data / n) for n in absent)}")
            continue
        print(fig.command.format(data=" ".join(str(data / n) for n in fig.data), png=img / fig.png))
        code = fig.replot(fig.argv(data, img / fig.png))
        if code:
            return code
    print(f"{len(FIGURES) - missing} of {len(FIGURES)} figures drawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
