"""The live-vs-discrete-event comparison: rank statistics on known answers, and the
`skymesh bench agree` mode end to end on a tiny trace (real replicas and balancer on
loopback for the live half)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from skymesh.bench import agreement
from skymesh.bench.agreement import compare, kendall_tau, ranking


def test_kendall_tau_known_answers() -> None:
    a = {"x": 3.0, "y": 2.0, "z": 1.0}
    assert kendall_tau(a, a) == 1.0
    assert kendall_tau(a, {"x": 1.0, "y": 2.0, "z": 3.0}) == -1.0
    # one of three pairs swapped: (2 - 1) / 3
    assert kendall_tau(a, {"x": 2.0, "y": 3.0, "z": 1.0}) == pytest.approx(1 / 3)
    # a tie counts neither way; systems only one side ran are ignored
    assert kendall_tau(a, {"x": 2.0, "y": 2.0, "z": 1.0, "w": 9.0}) == pytest.approx(2 / 3)
    assert kendall_tau({"x": 1.0}, {"x": 1.0}) is None


def test_ranking_best_first_ties_by_name() -> None:
    assert ranking({"b": 1.0, "a": 1.0, "c": 2.0}) == ["c", "a", "b"]


def _doc(goodputs: dict[str, float], scale: float = 1.0) -> dict[str, object]:
    return {"config": {"time_scale": scale},
            "systems": {s: {"goodput": g, "ttft_p50": 0.5} for s, g in goodputs.items()},
            "sweeps": {s: [{"slo_attainment": 0.95}, {"slo_attainment": 0.5}] for s in goodputs}}


def test_compare_rows_ranks_and_peer_ratios() -> None:
    live = _doc({"dualmap": 6.0, "round_robin": 4.0, "sglang-router": 3.0}, scale=0.5)
    sim = _doc({"dualmap": 5.0, "round_robin": 5.5})
    c = compare(live, sim)
    assert [r["system"] for r in c["rows"]] == ["dualmap", "round_robin"]
    assert c["ranking_live"] == ["dualmap", "round_robin"] and c["ranking_sim"] == ["round_robin", "dualmap"]
    assert c["kendall_tau"] == -1.0
    assert c["peers"]["sglang-router"]["reference_over_peer"] == pytest.approx(2.0)
    assert "vllm-router" not in c["peers"]
    # live TTFT is wall time at the time scale: 0.5 s at scale 0.5 is 1 s of trace time
    assert c["rows"][0]["ttft_p50_live"] == pytest.approx(1.0)
    md = agreement.agreement_markdown(c)
    assert "Kendall's tau" in md and "dualmap / sglang-router = 2.00" in md


@pytest.mark.timeout(180)
def test_agree_mode_end_to_end(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i * 200, "input_length": 400 + 20 * i, "output_length": 6,
             "hash_ids": [i % 2, 50 + i]} for i in range(10)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    p = argparse.ArgumentParser()
    agreement.add_arguments(p)
    args = p.parse_args(["--trace", str(trace), "--systems", "round_robin,dualmap", "--peers", "",
                         "--requests", "10", "--replicas", "2", "--profile", "tiny-test", "--rates", "1,2",
                         "--slo", "4", "--time-scale", "0.5", "--timeout-s", "60", "--out", str(tmp_path / "o")])
    assert agreement.run(args) == 0
    c = json.loads((tmp_path / "o" / "agreement.json").read_text())
    assert sorted(r["system"] for r in c["rows"]) == ["dualmap", "round_robin"]
    for r in c["rows"]:
        assert len(r["attainment_live"]) == len(r["attainment_sim"]) == 2
        assert r["ttft_p50_live"] is not None and r["ttft_p50_sim"] is not None
    assert (tmp_path / "o" / "sim" / "results.json").exists() and (tmp_path / "o" / "live" / "results.json").exists()
    assert "Kendall" in (tmp_path / "o" / "agreement.md").read_text()
