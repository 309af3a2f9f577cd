"""Trace handling and synthetic workloads on tiny hand-made inputs with known answers."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from skymesh.bench.traces import (
    TraceRequest,
    assign_regions,
    assign_sessions,
    diurnal,
    diurnal_factor,
    load_mooncake,
    lru_hit_rate,
    oracle_hit_rate,
    region_weights,
    scale_rate,
    scale_time,
    window,
)
from skymesh.bench.workloads import hot_prefix_workload, synthetic_conversations, tree_of_thoughts


def test_load_mooncake_and_sessions(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 700, "output_length": 5, "hash_ids": [0, 3]},
        # continues the first conversation (shares 3 blocks), then a new one sharing only block 0
        {"timestamp": 3000, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1, 2, 4]},
        {"timestamp": 3500, "input_length": 600, "output_length": 5, "hash_ids": [0, 5]},
        {"timestamp": 4000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 3, 6]},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = load_mooncake(p)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 2.0, 2.5, 3.0]
    assert [r.session for r in reqs] == [0, 1, 0, 2, 1]
    assert len(load_mooncake(p, first_n=2)) == 2


def test_a_trace_that_names_regions_and_sessions_keeps_them(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1], "session_id": "alice",
         "region": "eu-west-1"},
        # shares both blocks with alice's request: inference would merge it, the trace says otherwise
        {"timestamp": 10, "input_length": 1536, "output_length": 5, "hash_ids": [0, 1, 2], "session_id": "bob",
         "region": "us-east-1"},
        {"timestamp": 20, "input_length": 512, "output_length": 5, "hash_ids": [9], "session_id": "alice",
         "region": "eu-west-1"},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = load_mooncake(p)
    assert [r.session for r in reqs] == [0, 1, 0]
    assert [r.region for r in reqs] == ["eu-west-1", "us-east-1", "eu-west-1"]
    # the region assignment keeps what the trace says
    assert [r.region for r in assign_regions(reqs, ["us-east-1", "eu-west-1"], seed=1)] == [r.region for r in reqs]
    with pytest.raises(ValueError, match="ap-south-1"):
        assign_regions([TraceRequest(0, 1, 1, (1,), region="ap-south-1")], ["us-east-1"])
    # some rows with a session_id and some without: refused, not guessed
    p.write_text(json.dumps(rows[0]) + "\n" + json.dumps({k: v for k, v in rows[1].items() if k != "session_id"}))
    with pytest.raises(ValueError, match="all or none"):
        load_mooncake(p)


def test_the_lru_bound_counts_contiguous_prefixes_of_a_shared_cache_of_the_given_size() -> None:
    a = TraceRequest(0, 1024, 1, (1, 2))
    b = TraceRequest(1, 1024, 1, (3, 4))
    # room for everything: the oracle's figure
    reqs = [a, b, a, b]
    assert lru_hit_rate(reqs, 4 * 512) == pytest.approx(oracle_hit_rate(reqs)) == pytest.approx(0.5)
    # room for two blocks: a and b evict each other, nothing hits
    assert lru_hit_rate(reqs, 2 * 512) == 0.0
    # room for three: b evicts a's *tail* first (block 2), so a's prefix (block 1) still hits
    assert lru_hit_rate([a, b, a], 3 * 512) == pytest.approx(512 / 3072)
    # a hit only counts on the contiguous prefix
    assert lru_hit_rate([TraceRequest(0, 512, 1, (7,)), TraceRequest(1, 1024, 1, (8, 7))], 10 * 512) == 0.0


def test_conversations_sharing_only_a_long_system_prompt_are_never_merged() -> None:
    s0, s1 = 900, 901  # a two-block system prompt both conversations start with
    a = [(s0, s1, 10, 11), (s0, s1, 10, 11, 12), (s0, s1, 10, 11, 12, 13)]
    b = [(s0, s1, 20, 21), (s0, s1, 20, 21, 22)]
    order = [a[0], b[0], a[1], b[1], a[2]]
    reqs = [TraceRequest(float(i), 512 * len(ids), 1, ids) for i, ids in enumerate(order)]
    sessions = [r.session for r in assign_sessions(reqs)]
    # b's first turn shares two blocks with a's (the old rule merged them): its own session
    assert sessions[1] != sessions[0]
    assert sessions[2] == sessions[4] == sessions[0] and sessions[3] == sessions[1]


def test_sessions_need_two_shared_blocks() -> None:
    reqs = [TraceRequest(0, 512, 1, (7,)), TraceRequest(1, 512, 1, (7,)), TraceRequest(2, 1024, 1, (7, 8))]
    assert [r.session for r in assign_sessions(reqs)] == [0, 1, 2]
    assert [r.session for r in assign_sessions(reqs, min_shared_blocks=1)] == [0, 0, 0]


def test_scaling_and_window() -> None:
    reqs = [TraceRequest(t, 10, 1, (t,)) for t in (0.0, 1.0, 2.0, 4.0)]
    assert [r.arrival_s for r in scale_rate(reqs, 2.0)] == [0.0, 0.5, 1.0, 2.0]
    assert [r.arrival_s for r in scale_time(reqs, 0.5)] == [0.0, 0.5, 1.0, 2.0]
    assert [r.arrival_s for r in window(reqs, 1.0, 3.0)] == [0.0, 1.0]
    with pytest.raises(ValueError):
        scale_rate(reqs, 0.0)


def test_oracle_hit_rate_is_token_weighted() -> None:
    reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1536, 1, (1, 2, 3)), TraceRequest(2, 512, 1, (9,))]
    assert oracle_hit_rate(reqs) == pytest.approx(1024 / 3072)
    # a partial last block counts with its real length
    assert oracle_hit_rate([TraceRequest(0, 600, 1, (1, 2)), TraceRequest(1, 600, 1, (1, 2))]) == pytest.approx(0.5)


def test_region_weights_and_assignment_keep_sessions_together() -> None:
    assert region_weights(3, 0.0) == pytest.approx([1 / 3] * 3)
    assert region_weights(3, 0.5) == pytest.approx([2 / 3, 1 / 6, 1 / 6])
    reqs = [TraceRequest(i, 10, 1, (i,), session=i % 40) for i in range(400)]
    out = assign_regions(reqs, ["a", "b", "c"], skew=0.5, seed=3)
    by_session: dict[int, set[str]] = {}
    for r in out:
        by_session.setdefault(r.session, set()).add(r.region)
    assert all(len(v) == 1 for v in by_session.values())
    counts = Counter(next(iter(v)) for v in by_session.values())
    assert counts["a"] > counts["b"] and counts["a"] > counts["c"]


def test_diurnal_peaks_are_shifted_by_time_zone() -> None:
    assert diurnal_factor(0.0, 100.0, 0.0, 0.8) == pytest.approx(1.0)
    assert diurnal_factor(50.0, 100.0, 0.0, 0.8) == pytest.approx(0.2)
    assert diurnal_factor(50.0, 100.0, 0.5, 0.8) == pytest.approx(1.0)
    reqs = [TraceRequest(i * 0.01, 10, 1, (i,), region=("a" if i % 2 else "b")) for i in range(20_000)]
    kept = diurnal(reqs, ["a", "b"], period_s=200.0, seed=1)
    first_half = Counter(r.region for r in kept if r.arrival_s < 50 or r.arrival_s >= 150)
    second_half = Counter(r.region for r in kept if 50 <= r.arrival_s < 150)
    assert first_half["a"] > 1.5 * first_half["b"]  # a peaks at t=0, b half a period later
    assert second_half["b"] > 1.5 * second_half["a"]


def test_hot_prefix_workload() -> None:
    reqs = hot_prefix_workload(2000, rate_per_s=100.0, n_prompts=4, prompt_blocks=4, hot_share=0.8, seed=1)
    hot = Counter(r.hash_ids[:4] for r in reqs)
    top4 = sum(c for _, c in hot.most_common(4))
    assert 0.75 < top4 / len(reqs) < 0.85
    assert all(r.input_len == 6 * 512 for r in reqs)
    assert 15.0 < reqs[-1].arrival_s < 25.0  # 2000 Poisson arrivals at 100/s


@pytest.mark.parametrize(("branching", "depth"), [(2, 3), (4, 2)])
def test_tree_of_thoughts_shape(branching: int, depth: int) -> None:
    reqs = tree_of_thoughts(3, branching, depth, rate_per_s=1.0, root_blocks=2, seed=0)
    per_tree = sum(branching ** (d + 1) for d in range(depth))
    assert len(reqs) == 3 * per_tree
    by_ids = {r.hash_ids for r in reqs}
    for r in reqs:
        parent = r.hash_ids[:-1]
        assert len(parent) == 2 or parent in by_ids  # every non-root node extends its parent
    assert Counter(r.session for r in reqs) == {0: per_tree, 1: per_tree, 2: per_tree}


def test_synthetic_conversations_stream() -> None:
    reqs = list(synthetic_conversations(3000, ["x", "y"], rate_per_s=50.0, skew=0.5, seed=2))
    assert len(reqs) == 3000
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
    last: dict[int, TraceRequest] = {}
    for r in reqs:
        prev = last.get(r.session)
        if prev is not None:
            assert r.hash_ids[: len(prev.hash_ids)] == prev.hash_ids  # turns form a prefix chain
            assert r.region == prev.region
        last[r.session] = r
    regions = Counter(r.region for r in reqs)
    assert regions["x"] > regions["y"]


def test_fit_request_cuts_prompts_the_replica_cannot_run() -> None:
    from skymesh.bench.traces import fit_request

    long = TraceRequest(0.0, 40_000, 500, tuple(range(79)))
    cut = fit_request(long, max_model_len=32_768, kv_tokens=200_000)
    assert (cut.input_len, cut.output_len) == (32_268, 500)
    assert cut.hash_ids == tuple(range(64))  # ceil(32268 / 512) blocks kept, prefix intact
    # half the KV cache is the other bound
    assert fit_request(long, max_model_len=32_768, kv_tokens=20_000).input_len == 10_000
    fits = TraceRequest(1.0, 1000, 10, (1, 2))
    assert fit_request(fits, 32_768, 200_000) is fits


def _sessions(reqs: list[TraceRequest]) -> dict[int, list[TraceRequest]]:
    by: dict[int, list[TraceRequest]] = {}
    for r in reqs:
        by.setdefault(r.session, []).append(r)
    return by


def test_the_default_mix_draws_the_stream_as_it_always_was() -> None:
    from skymesh.bench.workloads import ConversationMix

    plain = list(synthetic_conversations(500, ["x", "y"], rate_per_s=50.0, seed=4))
    mixed = list(synthetic_conversations(500, ["x", "y"], rate_per_s=50.0, seed=4, mix=ConversationMix()))
    assert plain == mixed


def test_a_held_out_day_mix_caps_turns_grows_history_and_keeps_prompts_per_region() -> None:
    from skymesh.bench.workloads import ConversationMix

    regions = ["x", "y", "z"]
    mix = ConversationMix(turns_mean=3.0, max_turns=4, region_system_prompts=3, system_prompt_blocks=(1, 4),
                          shared_prefix_share=0.2)
    reqs = list(synthetic_conversations(6000, regions, rate_per_s=60.0, seed=1, mix=mix))
    own, shared = mix.prompts(3, 8, seed=1)
    assert all(1 <= len(p) <= 4 for ps in own for p in ps) and len({len(p) for ps in own for p in ps}) > 1
    by = _sessions(reqs)
    turns = Counter(len(v) for v in by.values())
    assert max(turns) == 4 and turns[4] > 0  # capped, and the cap is reached
    prompt_region: dict[tuple[int, ...], set[str]] = {}
    n_shared = 0
    for convo in by.values():
        for prev, nxt in zip(convo, convo[1:], strict=False):
            assert nxt.hash_ids[: len(prev.hash_ids)] == prev.hash_ids and len(nxt.hash_ids) > len(prev.hash_ids)
        first = convo[0]
        k = regions.index(first.region)
        opening = next(p for p in [*own[k], *shared] if first.hash_ids[: len(p)] == p)
        prompt_region.setdefault(opening, set()).add(first.region)
        n_shared += opening in shared
    # a region's own prompt is only ever opened in that region; the shared ones in several
    assert all(len(prompt_region.get(p, set())) <= 1 for ps in own for p in ps)
    assert any(len(prompt_region.get(p, set())) > 1 for p in shared)
    assert 0.1 < n_shared / len(by) < 0.3


def test_the_mix_refuses_what_it_cannot_draw() -> None:
    from skymesh.bench.workloads import ConversationMix

    for bad in ({"max_turns": 0}, {"system_prompt_blocks": (3, 2)}, {"shared_prefix_share": 0.1},
                {"region_system_prompts": 2, "shared_prefix_share": 1.5}, {"turns_mean": 0.5}):
        with pytest.raises(ValueError):
            ConversationMix(**bad)  # type: ignore[arg-type]


def test_sim_options_build_the_mix(tmp_path: Path) -> None:
    import argparse

    from skymesh.bench import sim_setup

    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    args = p.parse_args(["--trace", "synthetic", "--max-turns", "12", "--region-system-prompts", "4",
                         "--system-prompt-blocks", "1-4", "--shared-prefix-share", "0.025"])
    mix = sim_setup.conversation_mix(args)
    assert (mix.max_turns, mix.region_system_prompts, mix.system_prompt_blocks, mix.shared_prefix_share) == (
        12, 4, (1, 4), 0.025)
    with pytest.raises(SystemExit):
        sim_setup.conversation_mix(p.parse_args(["--trace", "synthetic", "--system-prompt-blocks", "a-b"]))
    with pytest.raises(SystemExit):
        sim_setup.conversation_mix(p.parse_args(["--trace", "synthetic", "--shared-prefix-share", "0.1"]))
