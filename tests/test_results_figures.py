"""The results page's figures: each benchmark command draws its PNG from the results JSON
it writes (`--png`), and again from a JSON written earlier (`--replot FILE --png OUT`);
benchmarks/results_plots.py redraws them all from a data folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import fleet_capacity, pd_split, results_plots, slo_mix, three_days
from skymesh.bench import figures, live

REPO = Path(__file__).resolve().parent.parent


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > len(figures.PNG_MAGIC) and data.startswith(figures.PNG_MAGIC)


def _sweep(rates: list[float], att: list[float]) -> list[dict[str, Any]]:
    return [{"rate_multiplier": m, "rate": 3.0 * m, "slo_attainment": a} for m, a in zip(rates, att, strict=True)]


PEERS = {"systems": {"dualmap": {"goodput": 15.1}, "sglang-router": {"goodput": 12.0}},
         "config": {"slo_s": 2.0, "requests": 600, "replicas": 8, "profile": "h100-qwen2.5-7b"},
         "sweeps": {"dualmap": _sweep([3, 4, 5], [1.0, 0.95, 0.6]),
                    "sglang-router": _sweep([3, 4, 5], [0.97, 0.85, 0.5])}}


def _plan(local: int, mesh: int, pooled: int) -> dict[str, Any]:
    return {"plans": {"region-local": {"a": local, "b": 1}, "mesh": {"a": mesh, "b": 1},
                      "pooled bound": {"a": pooled, "b": 1}},
            "mesh_saving": 1 - (mesh + 1) / (local + 1), "shape_ceiling": 0.3, "day": {"rate": 19.0}}


THREE_DAYS = [
    {"day": "balanced", "seed": 0, "rate_multiplier": 10.0, "free": _plan(4, 3, 3),
     "eu": {"plans": {"mesh": {"a": 3, "b": 2}}, "mesh_saving": 0.0}},
    {"day": "close-peaks", "seed": 0, "rate_multiplier": 9.0, "free": _plan(5, 5, 4),
     "eu": {"plans": {"mesh": {"a": 5, "b": 1}}, "mesh_saving": 0.0}},
    {"day": "one-big-region", "seed": 0, "error": "plan exited 1"},
]


def _window(rps: float, cpu: float) -> dict[str, float]:
    return {"rps": rps, "cpu_us_per_request": cpu}


FLEET = {"args": {"rate": 100.0},
         "runs": [{"balancers": n, "round": r, "moderate": _window(100, 2000 + 700 * n),
                   "open_200": _window(200, 1800 + 500 * n), "saturation": _window(180 + 30 * n, 3800 - 200 * n)}
                  for r in (0, 1) for n in (1, 2, 3)]}


def _point(mult: float, chat: float, batch: float) -> dict[str, Any]:
    return {"rate_multiplier": mult, "rejected": 0, "requests": 100,
            "classes": {"chat": {"slo_attainment": chat}, "batch": {"slo_attainment": batch}}}


SLO_MIX = [{"label": label, "seed": seed, "points": [_point(5, 0.8 - d, 1.0), _point(6, 0.6 - d - seed / 50, 0.98)]}
           for d, label in ((0.0, "fcfs"), (0.05, "fcfs, no early rejection")) for seed in (0, 1)]

PD = [{"system": s, "workload": w, "seed": seed, "goodput": g * (1 + seed / 10)}
      for w, base in (("long", 9.0), ("chat", 170.0))
      for s, g in (("aggregated", base), ("always@6:2", base * 1.2), ("conductor@0:0", base))
      for seed in (0, 1)]


def _write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("draw", "data"), [
    (figures.peers_figure, PEERS),
    (figures.geo_figure, THREE_DAYS),
    (figures.fleet_figure, FLEET),
    (figures.slo_mix_figure, SLO_MIX),
    (figures.pd_figure, PD),
], ids=["peers", "geo", "fleet", "slo_mix", "pd"])
def test_a_figure_is_a_png(tmp_path: Path, draw: Any, data: Any) -> None:
    out = draw(data, tmp_path / "sub" / "fig.png")
    assert out == tmp_path / "sub" / "fig.png"
    assert _is_png(out)


@pytest.mark.parametrize(("main", "data", "extra"), [
    (three_days.main, THREE_DAYS, []),
    (fleet_capacity.main, FLEET, []),
    (slo_mix.main, SLO_MIX, []),
    (pd_split.main, PD, ["--systems", "aggregated,always@6:2,conductor@0:0"]),
], ids=["three_days", "fleet_capacity", "slo_mix", "pd_split"])
def test_each_command_replots_a_json_it_wrote(tmp_path: Path, main: Any, data: Any, extra: list[str]) -> None:
    src = _write(tmp_path / "results.json", data)
    png = tmp_path / "fig.png"
    assert main(["--replot", str(src), "--png", str(png), *extra]) == 0
    assert _is_png(png)


def test_live_bench_replots_its_results_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a replot reads no trace: it works where the default trace is not
    monkeypatch.setattr(live, "DEFAULT_TRACE", str(tmp_path / "no-such-trace.jsonl"))
    src = _write(tmp_path / "results.json", PEERS)
    png = tmp_path / "peers.png"
    assert results_plots._live_replot(["--replot", str(src), "--png", str(png)]) == 0
    assert _is_png(png)


def test_a_replot_needs_the_figure_s_path(tmp_path: Path) -> None:
    src = _write(tmp_path / "results.json", SLO_MIX)
    with pytest.raises(SystemExit, match="--png"):
        slo_mix.main(["--replot", str(src)])


def test_pd_replot_merges_runs_and_keeps_the_named_systems() -> None:
    old = [{"system": "conductor@6:2", "workload": "long", "seed": 0, "goodput": 11.0},
           {"system": "aggregated", "workload": "long", "seed": 0, "goodput": 9.0}]
    new = [{"system": "conductor@6:2", "workload": "long", "seed": 0, "goodput": 12.0}]
    merged = figures.merge_pd_results([old, new])
    assert sorted((r["system"], r["goodput"]) for r in merged) == [("aggregated", 9.0), ("conductor@6:2", 12.0)]


def test_results_plots_draws_every_figure_from_a_data_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name, content in (("peers.json", PEERS), ("three_days.json", THREE_DAYS), ("fleet_capacity.json", FLEET),
                          ("slo_mix.json", SLO_MIX), ("pd_split.json", PD), ("pd_split_7.json", []),
                          ("pd_conductor.json", []), ("pd_elastic.json", [])):
        _write(data / name, content)
    img = tmp_path / "img"
    assert results_plots.main(["--data", str(data), "--img", str(img)]) == 0
    assert sorted(p.name for p in img.iterdir()) == sorted(f.png for f in results_plots.FIGURES)
    assert all(_is_png(p) for p in img.iterdir())



def test_the_committed_figures_redraw_from_the_committed_json(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert results_plots.main(["--data", str(REPO / "docs" / "data"), "--img", str(tmp_path)]) == 0
    drawn = {p.name for p in tmp_path.iterdir()}
    committed = {p.name for p in (REPO / "docs" / "img").glob("*.png")}
    assert drawn and drawn == committed
    assert all(_is_png(tmp_path / name) for name in drawn)
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")]
    assert len(drawn) + len(skipped) == len(results_plots.FIGURES)
