"""The discrete-event mode: exactness of the fused decode stretches, offload, the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from skymesh.assembly import RoutingConfig
from skymesh.bench import sim_main, sim_setup
from skymesh.bench.des import Simulator
from skymesh.bench.sim_chains import block_chains
from skymesh.bench.sim_config import SimConfig, simulated_policy
from skymesh.bench.traces import TraceRequest
from skymesh.bench.workloads import hot_prefix_workload
from skymesh.config.routing import OffloadConfig, OffloadRule, QueueConfig


def _trace(n: int, rate: float) -> list[TraceRequest]:
    # 2-block prompts (1 shared system block of 4 + a unique block), 40-token answers
    reqs = hot_prefix_workload(n, rate, n_prompts=4, prompt_blocks=1, hot_share=0.9, user_blocks=1,
                               output_len=40, seed=5)
    return [TraceRequest(r.arrival_s, 900, r.output_len, r.hash_ids, session=r.session) for r in reqs]


def test_block_chains_share_exactly_the_common_prefix() -> None:
    a_blocks, a_chunks = block_chains((1, 2, 3), 1400, 64, 512)
    b_blocks, b_chunks = block_chains((1, 2, 4), 1400, 64, 512)
    assert len(a_blocks) == 1400 // 64 and len(a_chunks) == 3
    assert a_blocks[:16] == b_blocks[:16] and a_blocks[16] != b_blocks[16]
    assert a_chunks[:2] == b_chunks[:2] and a_chunks[2] != b_chunks[2]


@pytest.mark.parametrize("policy", ["dualmap", "round_robin"])
def test_fused_decode_equals_stepping_every_iteration(policy: str) -> None:
    trace = _trace(300, 60.0)
    out = {}
    for fuse in (True, False):
        cfg = SimConfig(regions={"c": 3}, profile="tiny-test", block_size=16, fuse_decode=fuse,
                        routing=RoutingConfig(policy=simulated_policy(policy, ttft_slo_s=1.0)))
        out[fuse] = Simulator(cfg).run(trace)
    a, b = out[True], out[False]
    assert a.lazy_mismatches == 0
    assert a.events < b.events / 2  # the point of fusing
    assert np.allclose(a.ttft, b.ttft, atol=1e-9, equal_nan=True)
    assert np.allclose(a.e2e, b.e2e, atol=1e-9, equal_nan=True)
    assert a.prefix_hit_rate == b.prefix_hit_rate
    assert not np.isnan(a.e2e).any()  # every request finished


def test_cache_affinity_beats_round_robin_on_hit_rate() -> None:
    trace = _trace(300, 30.0)
    hits = {}
    for policy in ("prefix_tree", "round_robin"):
        cfg = SimConfig(regions={"c": 4}, profile="tiny-test", block_size=16,
                        routing=RoutingConfig(policy=simulated_policy(policy)))
        hits[policy] = Simulator(cfg).run(trace).prefix_hit_rate
    assert hits["prefix_tree"] > hits["round_robin"]


def test_overloaded_region_offloads_and_region_local_does_not() -> None:
    reqs = _trace(400, 80.0)
    trace = [TraceRequest(r.arrival_s, r.input_len, r.output_len, r.hash_ids, region="a", session=r.session)
             for r in reqs]
    shares = {}
    for offload in (True, False):
        cfg = SimConfig(regions={"a": 1, "b": 3}, one_way_ms={("a", "b"): 5.0}, profile="tiny-test",
                        block_size=16, routing=RoutingConfig(policy=simulated_policy("dualmap"),
                                                             offload=OffloadConfig(enabled=offload)))
        res = Simulator(cfg).run(trace)
        s = res.summary(1.0)
        assert s["completed"] == 400
        shares[offload] = (s["offloaded_share"], s["ttft_p90"])
    assert shares[True][0] > 0.2 and shares[False][0] == 0.0
    assert shares[True][1] < shares[False][1]


def test_system_suffixes_pick_offload_and_its_trigger_in_both_modes(tmp_path: Path) -> None:
    from skymesh.bench.live_geo import geo_mesh_config
    from skymesh.config import parse_config

    split = sim_setup.split_system
    assert split("dualmap", "predicted_ttft") == ("dualmap", True, "predicted_ttft")
    assert split("prefix_tree@saturated", "predicted_ttft") == ("prefix_tree", True, "saturated")
    assert split("dualmap@local", "predicted_ttft")[1] is False
    with pytest.raises(SystemExit, match="@local, @saturated or @pooled"):
        split("dualmap@fast", "predicted_ttft")
    args = argparse.Namespace(regions=3, replicas=2, region_replicas="eu-west-1=4")
    assert sim_setup.replicas_per_region(args, ["us-east-1", "eu-west-1"]) == {"us-east-1": 2, "eu-west-1": 4}
    with pytest.raises(SystemExit, match="REGION=N"):
        sim_setup.replicas_per_region(argparse.Namespace(replicas=2, region_replicas="mars-1=3"), ["us-east-1"])
    # the live mesh gets the same choices as a valid config
    free = parse_config(geo_mesh_config("dualmap", 1, "tiny-test", 1.0, 2.0, True, tmp_path,
                                        trigger="saturated", residency=False))
    assert free.offload.trigger == "saturated" and free.offload.rules == ()
    default = parse_config(geo_mesh_config("dualmap", 1, "tiny-test", 1.0, 2.0, True, tmp_path))
    assert default.offload.trigger == "predicted_ttft"
    assert not default.offload.allowed("eu-west-1", "us-east-1")
    assert all(len(r.balancer_members) == 1 for r in default.regions)
    # --balancers-per-region: that many members behind every region's entry
    fleet = parse_config(geo_mesh_config("dualmap", 1, "tiny-test", 1.0, 2.0, True, tmp_path,
                                         balancers_per_region=3))
    assert all(len(r.balancer_members) == 3 for r in fleet.regions)
    assert all(r.balancer.advertise != m.listen for r in fleet.regions for m in r.balancer_members)


def test_sim_cli_writes_report(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    args = p.parse_args(["--trace", "hot-prefix", "--requests", "200", "--rate", "20", "--replicas", "2",
                         "--profile", "tiny-test", "--block-size", "16", "--systems", "dualmap,round_robin",
                         "--rates", "1,4", "--slo", "1", "--jobs", "1", "--out", str(tmp_path)])
    assert sim_main.run(args) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["systems"]) == {"dualmap", "round_robin"}
    for m in data["systems"].values():
        for key in ("goodput", "slo_attainment", "ttft_p50", "ttft_p90", "prefix_hit_rate", "throughput"):
            assert key in m
    assert len(data["sweeps"]["dualmap"]) == 2
    assert data["config"]["oracle_prefix_hit_rate"] > 0
    for f in ("results.md", "ttft_cdf.png", "goodput_vs_rate.png", "replica_load.png"):
        assert (tmp_path / f).stat().st_size > 0


def test_goodput_search_reports_every_variant_the_bounds_and_only_agreed_rankings(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    args = p.parse_args(["--trace", "hot-prefix", "--requests", "150", "--rate", "10", "--replicas", "2",
                         "--profile", "tiny-test", "--block-size", "16", "--systems", "prefix_tree,round_robin",
                         "--goodput-search", "--seeds", "0,1", "--resolution", "0.1", "--slo", "1",
                         "--jobs", "1", "--out", str(tmp_path)])
    assert sim_main.run(args) == 0
    data = json.loads((tmp_path / "search.json").read_text())
    assert [v["seed"] for v in data["variants"]] == [0, 1]
    for row in data["rows"]:
        assert len(row["goodput"]) == 2 and all(g > 0 for g in row["goodput"])
        for search, rate in zip(row["searches"], data["base_rates"], strict=True):
            lo, hi = search["bracket"]
            assert hi is None or hi - lo <= 0.1 * lo + 1e-9
            # monotone: every evaluated rate up to the answer passed
            assert all(att >= 0.9 for r, att in search["evaluated"] if r <= lo)
            assert search["goodput_multiplier"] * rate in row["goodput"]
    for b in data["bounds"]:
        assert 0 < b["lru"] <= b["oracle"]
    assert len(data["rankings"]) == 1  # one pair
    assert (tmp_path / "search.md").read_text().count("| realistic bound") == 1


def test_sim_cli_cache_view_events() -> None:
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    common = ["--trace", "hot-prefix", "--requests", "150", "--rate", "20", "--replicas", "2",
              "--profile", "tiny-test", "--block-size", "16", "--slo", "1"]
    events = p.parse_args([*common, "--cache-view", "events"])
    cfg = sim_setup.sim_config(events, "prefix_tree")
    assert (cfg.cache_view, cfg.routing.policy.chunk_tokens, cfg.block_size) == ("events", 16, 16)
    history = sim_setup.sim_config(p.parse_args(common), "prefix_tree")
    assert (history.cache_view, history.routing.policy.chunk_tokens) == ("history", 512)
    assert sim_setup.sim_config(p.parse_args([*common, "--chunk-tokens", "16"]), "prefix_tree").routing.policy.chunk_tokens == 16
    with pytest.raises(SystemExit, match="--chunk-tokens must equal --block-size"):
        sim_setup.sim_config(p.parse_args([*common, "--cache-view", "events", "--chunk-tokens", "32"]), "prefix_tree")
    m = sim_setup.run_one(events, "prefix_tree", 1.0, False)["metrics"]
    h = sim_setup.run_one(p.parse_args([*common, "--block-size", "16"]), "prefix_tree", 1.0, False)["metrics"]
    assert m["completed"] == h["completed"] == 150
    # the events view predicts the engine's cached prefix better, and over-predicts less,
    # than the routing history (which counts blocks since evicted as cached)
    assert m["prediction_within_block"] > h["prediction_within_block"]
    assert m["prediction_over"] < h["prediction_over"]


def test_policy_options_from_the_command_line_arrive_typed() -> None:
    from skymesh.bench.sim_setup import parse_policy_options

    opts = parse_policy_options(["escape_over_slo=false", "max_hold_fraction=0.25", "virtual_nodes=64"])
    assert opts == {"escape_over_slo": False, "max_hold_fraction": 0.25, "virtual_nodes": 64}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_policy_options(["escape_over_slo"])


def test_history_view_results_are_unchanged() -> None:
    # pinned from the simulator before the "events" cache view existed (main at 1ef2763):
    # the default view must not move a single result. Re-pinned when a lone balancer
    # stopped returning a unit twice (BalancerCore._unit_back; docs/routing.md, "Reading the page"):
    # TTFT sum 7.5724 -> 7.5644, E2E sum 45.7193 -> 45.7210, hit rate and events unchanged
    reqs = hot_prefix_workload(300, 40.0, n_prompts=4, prompt_blocks=1, hot_share=0.9, user_blocks=1,
                               output_len=40, seed=5)
    trace = [TraceRequest(r.arrival_s, 900, r.output_len, r.hash_ids, session=r.session) for r in reqs]
    cfg = SimConfig(regions={"c": 3}, profile="tiny-test", block_size=16,
                    routing=RoutingConfig(policy=simulated_policy("prefix_tree", ttft_slo_s=1.0)))
    assert cfg.cache_view == "history"
    res = Simulator(cfg).run(trace)
    assert float(np.nansum(res.ttft)) == pytest.approx(7.564440315023036, rel=1e-12)
    assert float(np.nansum(res.e2e)) == pytest.approx(45.72103450174306, rel=1e-12)
    assert res.prefix_hit_rate == pytest.approx(0.44882962962962963, rel=1e-12)
    assert res.events == 1460


class _CheckedSimulator(Simulator):
    """Right after each step's events reached the region core: for every request whose
    prompt the engine just computed, the index's cached prefix vs the engine's own."""

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        self.chunks: dict[str, tuple[int, ...]] = {}
        self.compared: list[tuple[int, int]] = []  # (index chunks, engine blocks)

    def _admit(self, reg, k, rreq, t):  # type: ignore[no-untyped-def]
        self.chunks[rreq.request_id] = rreq.chunk_hashes
        return super()._admit(reg, k, rreq, t)

    def _apply(self, rep, out, t):  # type: ignore[no-untyped-def]
        reqs = {rid: rep.engine.requests.get(rid) for rid in out.first_token}
        done = super()._apply(rep, out, t)
        index = self.regions[rep.region].kv_indexes
        assert index is not None
        bs = self.cfg.block_size
        for rid, er in reqs.items():
            if er is None:  # finished in the same step: its blocks may be evicted already
                continue
            full = er.prompt_len // bs
            engine_blocks = len(rep.engine.pool.lookup(er.block_hashes, full))
            self.compared.append((index.by_replica[rep.rid].cached_chunks(self.chunks[rid][:full]), engine_blocks))
        return done


@pytest.mark.parametrize("policy", ["prefix_tree", "dualmap"])
def test_events_view_index_matches_the_engine_cache(policy: str) -> None:
    # a KV-tight cache (tiny-test: 256 blocks of 16) so blocks are evicted and re-stored
    trace = _trace(300, 40.0)
    cfg = SimConfig(regions={"c": 3}, profile="tiny-test", block_size=16, cache_view="events",
                    routing=RoutingConfig(policy=simulated_policy(policy, ttft_slo_s=1.0, chunk_tokens=16)))
    sim = _CheckedSimulator(cfg)
    res = sim.run(trace)
    assert not np.isnan(res.e2e).any()
    assert len(sim.compared) > 250
    assert all(abs(a - b) <= 1 for a, b in sim.compared), [c for c in sim.compared if abs(c[0] - c[1]) > 1][:5]
    assert sum(b for _, b in sim.compared) > 0  # prompts were cached
    evicted = sum(r.engine.evictions for r in sim.replicas.values())
    assert evicted > 0
    # the policy read the index: its predictions match what the engine served
    acc = res.prediction_accuracy(16)
    assert acc is not None and acc > 0.95


def test_events_view_needs_chunks_equal_to_blocks() -> None:
    with pytest.raises(ValueError, match="chunk_tokens == block_size"):
        Simulator(SimConfig(regions={"c": 1}, profile="tiny-test", block_size=16, cache_view="events"))


def test_simulated_classes_get_their_priority_and_a_report_each() -> None:
    from skymesh.bench.traces import assign_slo_classes
    from skymesh.config import SloClassConfig

    # 120 req/s on 4 tiny replicas: a queue builds, and who waits in it is the priority's call
    trace = assign_slo_classes(_trace(400, 120.0), {"gold": 1, "bronze": 1}, seed=3)
    assert {r.slo_class for r in trace} == {"gold", "bronze"}
    by_session: dict[int, set[str]] = {}
    for r in trace:
        by_session.setdefault(r.session, set()).add(r.slo_class)
    assert all(len(c) == 1 for c in by_session.values())  # a conversation keeps its class
    figures = {}
    for gold_priority in (5, 0):
        classes = {"gold": SloClassConfig(ttft_s=1.0, priority=gold_priority), "bronze": SloClassConfig(ttft_s=1.0)}
        cfg = SimConfig(regions={"c": 4}, profile="tiny-test", block_size=16, slo_classes=classes,
                        routing=RoutingConfig(policy=simulated_policy("least_load"), early_rejection=False))
        figures[gold_priority] = Simulator(cfg).run(trace).class_summaries()
    gold, bronze = figures[5]["gold"], figures[5]["bronze"]
    assert gold["requests"] + bronze["requests"] == 400
    assert gold["ttft_mean"] < 0.5 * bronze["ttft_mean"]
    assert gold["slo_attainment"] > bronze["slo_attainment"]
    # the same classes without the priority share the queue alike
    even_gold, even_bronze = figures[0]["gold"], figures[0]["bronze"]
    assert 0.5 < even_gold["ttft_mean"] / even_bronze["ttft_mean"] < 2.0
    assert gold["ttft_mean"] < even_gold["ttft_mean"] < bronze["ttft_mean"]


def test_sim_cli_mixes_classes_and_reports_each(tmp_path: Path) -> None:
    classes = tmp_path / "classes.yaml"
    classes.write_text("slo_classes:\n  chat: {ttft_s: 1.0, priority: 1}\n  batch: {e2e_s: 60.0}\n")
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    argv = ["--trace", "hot-prefix", "--requests", "200", "--rate", "20", "--replicas", "2", "--profile", "tiny-test",
            "--block-size", "16", "--systems", "dualmap", "--rates", "1", "--jobs", "1", "--out", str(tmp_path),
            "--slo-classes", str(classes), "--slo-mix", "chat=0.7,batch=0.3"]
    assert sim_main.run(p.parse_args(argv)) == 0
    got = json.loads((tmp_path / "results.json").read_text())["sweeps"]["dualmap"][0]["classes"]
    assert set(got) == {"chat", "batch"} and got["chat"]["requests"] + got["batch"]["requests"] == 200
    assert got["chat"]["requests"] > got["batch"]["requests"]
    for bad in (["--slo-mix", "gold=1"], ["--slo-mix", "chat=x"]):
        with pytest.raises(SystemExit):
            sim_setup.build_trace(p.parse_args(argv[:-2] + bad))
    classes.write_text("slo_classes:\n  chat: {}\n")
    with pytest.raises(SystemExit, match="slo_classes.chat"):
        sim_setup.slo_classes(p.parse_args(argv))


def test_the_simulator_drives_the_prefix_discipline_and_loses_nothing() -> None:
    # many long shared contexts on three small replicas, past saturation: the queue holds
    # requests whose context a freed replica has, and the discipline picks them
    reqs = hot_prefix_workload(400, 40.0, n_prompts=12, prompt_blocks=8, hot_share=0.95, user_blocks=1,
                               output_len=40, seed=5)
    sim = Simulator(SimConfig(regions={"c": 3}, profile="tiny-test", block_size=16,
                              routing=RoutingConfig(policy=simulated_policy("least_load", ttft_slo_s=1.0),
                                                    queue=QueueConfig(discipline="prefix"))))
    res = sim.run(reqs)
    assert not np.isnan(res.e2e).any()  # every request finished
    discipline = sim.regions["c"].core.local.discipline
    assert discipline is not None
    stats = discipline.stats()
    assert stats["queued"] == 0 and stats["picks_matched"] > 0 and stats["decisions"] > 0


@pytest.mark.parametrize("policy", ["dualmap", "prefix_tree", "least_load"])
def test_a_region_of_three_balancers_serves_everything_within_one_push_budget(policy: str) -> None:
    """Past saturation (a queue at every balancer): with three balancers sharing the
    replicas' push budgets, every request is served, no replica's own queue ever holds
    more requests pushed and not yet admitted than one balancer's budget (requests the
    replica preempted back to its queue are its own KV pressure, not pushes), and each
    balancer's trie learned its siblings' placements."""
    trace = _trace(300, 60.0)
    cfg = SimConfig(regions={"c": 4}, profile="tiny-test", block_size=16, balancers_per_region=3,
                    routing=RoutingConfig(policy=simulated_policy(policy)))
    sim = Simulator(cfg)
    res = sim.run(trace)
    s = res.summary(1.0)
    assert s["completed"] == 300
    budget = sim.regions["c"].core.settings.dispatch_budget
    assert 0 < res.max_replica_unadmitted <= budget
    cores = sim.regions["c"].cores
    assert all(c.view.counters.dispatched > 50 for c in cores)  # each took its share of the work
    assert all(c.siblings is not None and c.siblings.placements_applied > 50 for c in cores)


# ---------------------------------------------------------------- the pooled bound

def _from(region: str, n: int, rate: float) -> list[TraceRequest]:
    return [TraceRequest(r.arrival_s, r.input_len, r.output_len, r.hash_ids, region=region, session=r.session)
            for r in _trace(n, rate)]


def _geo(kind: str, regions: dict[str, int], one_way_ms: dict[tuple[str, str], float],
         rules: tuple[OffloadRule, ...] = ()) -> SimConfig:
    """``local`` (no offload), ``mesh`` (a region core per region, offload on) or ``pooled``."""
    return SimConfig(regions=regions, one_way_ms=one_way_ms, profile="tiny-test", block_size=16,
                     routing=RoutingConfig(policy=simulated_policy("dualmap"),
                                           offload=OffloadConfig(enabled=kind == "mesh", rules=rules)),
                     pooled=kind == "pooled")


@pytest.mark.parametrize("rate", [80.0, 120.0])
def test_pooled_bound_is_not_below_the_mesh_and_beats_region_local(rate: float) -> None:
    # region a gets every request on 1 replica, region b's 3 replicas are idle
    trace = _from("a", 400, rate)
    got = {}
    for kind in ("local", "mesh", "pooled"):
        sim = Simulator(_geo(kind, {"a": 1, "b": 3}, {("a", "b"): 5.0}))
        s = sim.run(trace).summary(1.0)
        assert s["completed"] == 400
        got[kind] = s
    # the pool is one region core holding every replica (the mesh's ids), with their homes
    pool = Simulator(_geo("pooled", {"a": 1, "b": 3}, {("a", "b"): 5.0}))
    assert list(pool.regions) == ["pool"] and len(pool.regions["pool"].cores) == 1
    assert sorted(pool.regions["pool"].core.view.replicas) == ["a/r0", "b/r0", "b/r1", "b/r2"]
    assert {r.region for r in pool.replicas.values()} == {"a", "b"}
    local, mesh, pooled = got["local"], got["mesh"], got["pooled"]
    assert pooled["slo_attainment"] >= mesh["slo_attainment"] >= local["slo_attainment"]
    assert pooled["slo_attainment"] >= local["slo_attainment"] + 0.5  # clearly: local serves <10%
    assert pooled["ttft_p90"] <= mesh["ttft_p90"] and pooled["ttft_p50"] <= mesh["ttft_p50"]
    assert pooled["offloaded_share"] > 0.5  # most of a's clients are served in b


def test_pooled_bound_charges_the_link_both_ways() -> None:
    one_way = 0.05
    trace = _from("a", 200, 60.0)
    res = Simulator(_geo("pooled", {"a": 1, "b": 1}, {("a", "b"): one_way * 1000})).run(trace)
    far, home = res.ttft[res.offloaded], res.ttft[~res.offloaded]
    assert far.size > 20 and home.size > 20 and not np.isnan(res.ttft).any()
    # prompt out one way, first token back the other: a far request's TTFT is at least the RTT
    assert far.min() >= 2 * one_way
    assert (res.e2e[res.offloaded] >= 2 * one_way).all()
    assert home.min() < 2 * one_way  # served at home, nothing is charged
    # the same pool with a free link: the far requests got faster by about the RTT
    free = Simulator(_geo("pooled", {"a": 1, "b": 1}, {})).run(trace)
    assert np.median(free.ttft[free.offloaded]) < np.median(far) - one_way


def test_the_pool_holds_the_residency_rules_its_config_carries() -> None:
    from skymesh.bench.sim_setup import EU_STAYS_IN_EU

    # a burst of EU clients (the EU replica alone cannot keep up), then US clients
    eu = _from("eu-west-1", 200, 60.0)
    us = [TraceRequest(r.arrival_s + 60.0, r.input_len, r.output_len, (9, *r.hash_ids[1:]),
                       region="us-east-1", session=r.session + 10_000) for r in _trace(100, 30.0)]
    trace = sorted(eu + us, key=lambda r: r.arrival_s)
    is_eu = np.array([r.region == "eu-west-1" for r in trace])
    layout = ({"eu-west-1": 1, "us-east-1": 3}, {("eu-west-1", "us-east-1"): 40.0})
    ruled = Simulator(_geo("pooled", *layout, rules=(EU_STAYS_IN_EU,))).run(trace)
    free = Simulator(_geo("pooled", *layout)).run(trace)
    for res in (ruled, free):
        assert not np.isnan(res.ttft).any() and not res.rejected.any()
    # under the rule no EU request ran outside the EU; US clients still use the EU replica
    # (the rule binds EU clients only)
    assert not ruled.offloaded[is_eu].any()
    assert ruled.offloaded[~is_eu].any() and free.offloaded[~is_eu].any()
    # without it the pool sends EU clients to the US replicas too
    assert free.offloaded[is_eu].sum() > 20


def test_pooled_bound_on_the_command_line(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    common = ["--trace", "hot-prefix", "--requests", "150", "--rate", "10", "--regions", "3", "--replicas", "1",
              "--skew", "0.6", "--profile", "tiny-test", "--block-size", "16", "--slo", "1", "--jobs", "1"]
    args = p.parse_args([*common, "--systems", "dualmap,dualmap@local", "--pooled-bound"])
    assert sim_setup.systems_of(args) == ["dualmap", "dualmap@local", "dualmap@pooled"]
    assert sim_setup.split_system("dualmap@pooled", "predicted_ttft")[:2] == ("dualmap", False)
    cfg = sim_setup.sim_config(args, "dualmap@pooled")
    # the bound: one pool, no offload, and no residency rule even where the run has the EU rule
    assert cfg.pooled and not cfg.offload and cfg.routing.offload.rules == ()
    assert sim_setup.sim_config(args, "dualmap").routing.offload.rules == (sim_setup.EU_STAYS_IN_EU,)
    assert not sim_setup.sim_config(args, "dualmap").pooled
    with pytest.raises(SystemExit, match="--regions 2 or more"):
        sim_setup.systems_of(p.parse_args(["--trace", "hot-prefix", "--systems", "dualmap", "--pooled-bound"]))
    assert sim_setup.of_pooled({"dualmap": [8.0, 9.0], "dualmap@local": [4.0, 3.0], "dualmap@pooled": [10.0, 9.0],
                               "round_robin": [5.0, 5.0]}) == {"dualmap": [0.8, 1.0], "dualmap@local": [0.4, 1 / 3]}
    # a goodput search reports each system as a fraction of its policy's bound
    search = p.parse_args([*common, "--systems", "dualmap@local", "--pooled-bound", "--goodput-search",
                           "--resolution", "0.1", "--out", str(tmp_path)])
    assert sim_main.run(search) == 0
    data = json.loads((tmp_path / "search.json").read_text())
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == {"dualmap@local", "dualmap@pooled"}
    local, pooled = rows["dualmap@local"]["goodput"][0], rows["dualmap@pooled"]["goodput"][0]
    assert pooled > local
    assert rows["dualmap@local"]["of_pooled"] == [local / pooled]
    md = (tmp_path / "search.md").read_text()
    assert "× pooled bound per variant" in md and f"| {local / pooled:.3g} |" in md
