"""benchmarks/pd_live.py on a tiny region: every system's cell is measured and written, a
fixed split pulls every served request's KV and aggregated none, and vllm-router's P/D
mode (when installed) is served by the NIXL-pull stand-ins."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.pd_live import main, pools, roles, skymesh_config, tbt_of
from skymesh.bench.peers import peer_available
from skymesh.config.load import parse_config


def test_tbt_is_the_mean_of_the_longest_tenth() -> None:
    assert tbt_of([0.01] * 18 + [0.5, 0.3]) == pytest.approx(0.4)  # 2 of 20 intervals
    assert tbt_of([0.2]) == 0.2
    assert math.isnan(tbt_of([]))


def test_a_systems_pools() -> None:
    assert pools("aggregated", 4) == ("never", 0, 0)
    assert pools("conductor@1:1", 4) == ("conductor", 1, 1)
    assert roles(1, 1, 4) == ["prefill", "decode", "both", "both"]
    with pytest.raises(ValueError, match="P \\+ D"):
        pools("vllm-router@1:1", 4)  # it has no `both` replicas
    with pytest.raises(ValueError, match="unknown"):
        pools("sometimes@1:1", 4)
    assert pools("elastic@0:0", 4) == ("elastic", 0, 0)
    assert pools("conductor@1:1+prefill_pool", 4) == ("conductor", 1, 1)
    for no_rule in ("aggregated+prefill_pool", "vllm-router@3:1+prefill_pool"):
        with pytest.raises(ValueError, match="options"):
            pools(no_rule, 4)


def test_a_rules_options_reach_the_balancers_region_core() -> None:
    """``rule@P:D+option`` runs the rule with that option on: the region core built from
    the balancer's config, as the daemon builds it, has the rule with the option set."""
    import argparse

    from skymesh.assembly import region_assembly
    from skymesh.routing.assembly import build_region_core

    args = argparse.Namespace(policy="dualmap", ttft=2.0, tbt=0.1, kv_gbps=100.0, profile="h100-qwen2.5-7b")
    for options, on in (({"prefill_pool": True}, True), ({}, False)):
        cfg = parse_config(skymesh_config("conductor", roles(1, 1, 4), [9001, 9002, 9003, 9004], args, 1.0, 5.0,
                                          options))
        region = cfg.regions[0].name
        core = build_region_core(region_assembly(cfg, region, "dualmap", kv_events=False))
        rule = core.local.pair_rule
        assert rule is not None and rule.options.prefill_pool is on  # type: ignore[attr-defined]


def test_a_tiny_run_writes_every_cell(tmp_path: Path) -> None:
    systems = ["aggregated", "always@1:1"] + (["vllm-router@1:1"] if peer_available("vllm-router") else [])
    out = tmp_path / "pd.json"
    assert main(["--systems", ",".join(systems), "--workloads", "chat", "--runs", "1", "--replicas", "2",
                 "--profile", "h100-qwen2.5-7b", "--chat-rate", "20", "--chat-seconds", "0.5", "--chat-output", "4,8",
                 "--chat-time-scale", "0.2", "--out", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert [c["system"] for c in cells] == systems
    for c in cells:
        assert c["requests"] == 10 and c["served"] == 10, c
        assert c["short_streams"] == 0 and not c["errors"], c
        assert c["ttft_p50"] is not None and c["tbt_p50"] is not None
        assert c["kv_failed"] == 0 and c["kv_expired"] == 0
        assert c["router_cpu_ms_per_request"] is not None
    by = {c["system"]: c for c in cells}
    assert by["aggregated"]["split_share"] == 0
    assert by["always@1:1"]["split_share"] == 1
    if "vllm-router@1:1" in by:
        assert by["vllm-router@1:1"]["split_share"] == 1
