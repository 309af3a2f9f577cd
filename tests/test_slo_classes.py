"""SLO classes: config, which class a request gets, priority order in the queue, no
offload a class's TTFT cannot afford, the class on forwarded requests, and the
per-class counters on the balancer's page."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from skymesh.balancer.request_flow import ORIGIN_HEADER
from skymesh.balancer.server import Balancer
from skymesh.balancer.slo_class_lookup import SLO_CLASS_HEADER, resolve_slo_class
from skymesh.config import ConfigError, SloClassConfig, parse_config
from skymesh.edge.openai_errors import RequestError
from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.dispatcher import BalancerCore
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.health import ProbeSample
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.queueing import PriorityQueue
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import ForwardToRegion, Reject, SendToReplica
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy
from skymesh.runtime.procs import free_port
from skymesh.slo_judge import SloClass, apply_slo_class, missed_targets
from tests.mesh_helpers import one_region_config
from tests.test_balancer_faults import FakeReplica, start_balancer

pytestmark = pytest.mark.timeout(60)

CLASSES = {
    "code": {"ttft_s": 0.05, "priority": 10},  # tighter than any cross-region round trip
    "chat": {"ttft_s": 2.0, "tpot_s": 0.1},
    "batch": {"e2e_s": 30.0, "priority": -5},
}
KEY = "sk-slo-test"


def config(**extra: Any) -> dict[str, Any]:
    data = one_region_config({"r0": "http://127.0.0.1:9"}, 18000, 18001)
    data["slo_classes"] = CLASSES
    data.update(extra)
    return data


def req(i: int, priority: int = 0, ttft: float | None = None) -> RoutingRequest:
    text = " ".join(f"q{i}w{k}" for k in range(64))
    return RoutingRequest(f"q{i}", prompt_chunk_hashes(text, 64), 64, 0.0, slo_ttft_s=ttft, priority=priority)


# ----------------------------------------------------------------------------- config


def test_classes_load_and_every_bad_one_names_its_path() -> None:
    cfg = parse_config(config(default_slo_class="chat"))
    assert cfg.slo_classes["code"] == SloClassConfig(ttft_s=0.05, priority=10)
    assert cfg.default_slo_class == "chat"
    cases = [
        ({"slo_classes": {"chat": {}}}, "slo_classes.chat.ttft_s"),  # no target at all
        ({"slo_classes": {"chat": {"ttft_s": 0}}}, "slo_classes.chat.ttft_s"),
        ({"slo_classes": {"chat": {"ttft_s": 1, "tbt_s": 1}}}, "slo_classes.chat.tbt_s"),
        ({"slo_classes": {"Chat!": {"ttft_s": 1}}}, "slo_classes.Chat![key]"),
        ({"default_slo_class": "gold"}, "default_slo_class"),
        ({"client_auth": {"keys": [{"name": "a", "sha256": "0" * 64, "slo_class": "gold"}]}},
         "client_auth.keys[0].slo_class"),
    ]
    for extra, path in cases:
        with pytest.raises(ConfigError) as e:
            parse_config(config(**extra))
        assert e.value.path == path, extra


# ----------------------------------------------------------------------------- resolution


def test_header_then_key_then_default_and_an_unknown_name_is_a_400() -> None:
    cfg = parse_config(config(default_slo_class="chat"))
    got = resolve_slo_class(cfg, "code", "batch")
    assert got is not None and got.name == "code"  # the header wins over the key's class
    got = resolve_slo_class(cfg, None, "batch")
    assert got is not None and got.name == "batch"
    got = resolve_slo_class(cfg, None, None)
    assert got is not None and got.name == "chat"
    assert resolve_slo_class(parse_config(config()), None, None) is None  # no default: no class
    for bad in ("gold", "", "CODE", "x" * 500):
        with pytest.raises(RequestError) as e:
            resolve_slo_class(cfg, bad, None)
        assert e.value.status == 400 and e.value.code == "invalid_slo_class"
        assert len(e.value.message) < 200  # the client's text is not echoed whole
    # no classes configured: naming one is still an error, not silently ignored
    with pytest.raises(RequestError):
        resolve_slo_class(parse_config(one_region_config({"r0": "http://127.0.0.1:9"}, 18000, 18001)), "chat", None)


def test_a_class_stamps_its_targets_and_an_end_to_end_class_bounds_the_ttft() -> None:
    r = req(0)
    apply_slo_class(r, SloClass("code", SloClassConfig(ttft_s=0.05, priority=10)))
    assert (r.slo_class, r.slo_ttft_s, r.priority) == ("code", 0.05, 10)
    r = req(1)
    apply_slo_class(r, SloClass("batch", SloClassConfig(e2e_s=30.0, priority=-5)))
    assert (r.slo_ttft_s, r.slo_e2e_s, r.priority) == (30.0, 30.0, -5)
    r = req(2)
    apply_slo_class(r, None)
    assert (r.slo_class, r.slo_ttft_s, r.priority) == ("", None, 0)


def test_targets_are_judged_only_where_they_can_be() -> None:
    chat = SloClassConfig(ttft_s=1.0, tpot_s=0.1, e2e_s=10.0)
    assert missed_targets(chat, e2e_s=3.0, ttft_s=0.5, completion_tokens=26) == []  # 2.5 s / 25 tokens
    assert missed_targets(chat, e2e_s=3.0, ttft_s=1.5, completion_tokens=11) == ["ttft", "tpot"]  # 0.15 s a token
    assert missed_targets(chat, e2e_s=12.0, ttft_s=0.5, completion_tokens=None) == ["e2e"]
    # a non-streamed answer (no first-token time) is judged end to end only
    assert missed_targets(chat, e2e_s=5.0, ttft_s=None, completion_tokens=2) == []


# ----------------------------------------------------------------------------- queue order


def test_priority_queue_orders_by_priority_then_arrival_and_front_within_its_priority() -> None:
    q: PriorityQueue[str] = PriorityQueue()
    for rid, prio in (("a", 0), ("b", -5), ("c", 10), ("d", 0), ("e", 10)):
        q.push(rid, rid, prio)
    q.push("f", "f", 0, front=True)  # a retry: ahead of its own priority only
    assert q.ids() == ["c", "e", "f", "a", "d", "b"]
    assert list(q.values()) == q.ids()
    assert q.pop("e") == "e" and q.pop("c") == "c" and q.pop("zz") is None
    assert q.ids() == ["f", "a", "d", "b"] and len(q) == 4 and "a" in q and "c" not in q
    with pytest.raises(ValueError):
        q.push("a", "a", 3)


def test_a_higher_priority_request_queued_later_is_placed_first_and_keeps_it_on_retry() -> None:
    core = BalancerCore(make_policy("least_load", PolicyContext()), dispatch_budget=1)
    core.set_replicas(["r0"])
    for r in (req(0), req(1), req(2, priority=5)):
        core.submit(r)
    core.update_replica("r0", healthy=True)
    placed = core.dispatch(0.0)
    assert [r.request_id for r, _ in placed] == ["q2"]
    # its replica fails it before any output: back ahead of the priority-0 requests
    core.update_replica("r0", healthy=True, num_running=1)
    assert core.retry("q2", 0.1) is True
    assert [r.request_id for r in core.iter_queued()] == ["q2", "q0", "q1"]


# ----------------------------------------------------------------------------- offload


def test_a_class_whose_ttft_the_round_trip_uses_up_is_never_offloaded() -> None:
    for trigger in ("predicted_ttft", "saturated"):
        router = OffloadRouter("here", {"near": 0.04, "far": 0.2}, trigger=trigger)  # type: ignore[arg-type]
        for region in ("near", "far"):
            router.update_peer(region, now=0.0, seq=1, replicas_total=4, replicas_available=4, placements_per_s=10.0)
        wait_here = 5.0 if trigger == "predicted_ttft" else None
        assert router.choose(req(0, ttft=0.05), 0.0, wait_here) == "near"  # 40 ms fits in 50 ms
        assert router.choose(req(1, ttft=0.03), 0.0, wait_here) is None  # nothing fits in 30 ms
        assert router.choose(req(2), 0.0, wait_here) == "near"  # no class: no limit
        assert not router.could_serve(0.0, None, 0.03) and router.could_serve(0.0, None, 0.05)


def test_a_class_that_can_go_nowhere_gets_an_immediate_503_when_its_replicas_are_gone() -> None:
    offload = OffloadRouter("here", {"there": 0.08})
    core = RegionCore("here", make_policy("least_load", PolicyContext()), offload)
    core.set_replicas(["r0"], 0.0)
    core.peer_heartbeat("there", _beat(), 0.0)
    core.probe("r0", ProbeSample(), 0.0)
    for _ in range(3):  # ejected: three failed probes in a row
        core.probe("r0", None, 0.0)
    assert core.view.ejected_count() == 1
    tight = req(0, ttft=0.05)  # 80 ms round trip: the peer is out of its reach
    actions = core.submit(tight, 0.01)
    assert len(actions) == 1 and isinstance(actions[0], Reject) and actions[0].status == 503
    assert core.submit(req(1, ttft=2.0), 0.01) == []  # a looser class waits for the peer


def _beat() -> HeartbeatSnapshot:
    return HeartbeatSnapshot(replicas_total=2, replicas_available=2, queue_length=0, pending_prefill_tokens=0,
                             placements_per_s=5.0)


# ----------------------------------------------------------------------------- the balancer


@pytest.fixture
async def slow_replica() -> AsyncIterator[FakeReplica]:
    r = FakeReplica("r0", service_s=0.3)
    await r.start()
    yield r
    await r.stop()


async def post(b: Balancer, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    payload = {"model": "skymesh-sim", "prompt": "abcd" * 8, "max_tokens": 4}
    async with aiohttp.ClientSession() as s, s.post(
        f"http://127.0.0.1:{b.bound_port}/v1/completions", json=payload, headers=headers
    ) as r:
        return r.status, await r.json()


async def counters(b: Balancer) -> dict[tuple[str, tuple[str, ...]], float]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{b.bound_port}/metrics") as r:
        text = await r.text()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("skymesh_slo_", "skymesh_client_")):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.values())))] = sample.value
    return out


async def test_the_balancer_refuses_unknown_classes_and_counts_each_class_s_outcome(
    slow_replica: FakeReplica,
) -> None:
    # every answer takes 0.3 s: "rush" (e2e 0.1 s) misses, "chat" (e2e 30 s) meets; the
    # key's own class applies when the request names none
    classes = {"rush": {"e2e_s": 0.1}, "chat": {"e2e_s": 30.0}}
    keys = {"keys": [{"name": "k", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "slo_class": "rush"}],
            "keys_env": None}
    b = await start_balancer([slow_replica], slo_classes=classes, client_auth=keys)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        status, doc = await post(b, {**auth, SLO_CLASS_HEADER: "platinum"})
        assert status == 400 and doc["error"]["code"] == "invalid_slo_class"
        assert doc["error"]["type"] == "invalid_request_error"
        assert slow_replica.received == 0  # refused before it cost a replica anything
        assert (await post(b, {**auth, SLO_CLASS_HEADER: "chat"}))[0] == 200
        assert (await post(b, auth))[0] == 200  # the key's class: rush
        got = await counters(b)
        assert got[("skymesh_slo_requests_total", ("chat",))] == 1
        assert got[("skymesh_slo_requests_total", ("rush",))] == 1
        assert got[("skymesh_slo_outcomes_total", ("chat", "met"))] == 1
        assert got[("skymesh_slo_outcomes_total", ("missed", "rush"))] == 1
        assert got[("skymesh_slo_target_misses_total", ("e2e", "rush"))] == 1
        assert ("skymesh_slo_target_misses_total", ("chat", "e2e")) not in got
        # what the clients saw, per class, served here: each answer took the replica's 0.3 s
        for cls in ("chat", "rush"):
            labels = tuple(sorted((b.region, cls, "local")))
            assert got[("skymesh_client_e2e_seconds_count", labels)] == 1
            assert got[("skymesh_client_e2e_seconds_sum", labels)] >= 0.3
            # not streamed: no first token the client saw before the whole answer
            assert ("skymesh_client_ttft_seconds_count", labels) not in got
    finally:
        await b.stop()


async def test_a_forward_carries_the_class_to_the_peer() -> None:
    data = one_region_config({"r0": "http://127.0.0.1:9"}, free_port(), free_port())
    data["regions"].append({
        "name": "eu-west-1", "source_networks": ["127.2.0.0/16"],
        "balancer": {"listen": f"127.0.0.1:{free_port()}", "grpc_listen": f"127.0.0.1:{free_port()}",
                     "peer_listen": f"127.0.0.1:{free_port()}"},
        "replicas": [{"id": "e0", "url": "http://127.0.0.1:9"}],
    })
    data["latencies"] = [{"regions": ["eu-west-1", "us-east-1"], "one_way_ms": 40}]
    data["slo_classes"] = CLASSES
    b = Balancer(parse_config(data), "us-east-1")
    await b.start(port=0)
    try:
        r = req(0)
        apply_slo_class(r, SloClass("chat", SloClassConfig(ttft_s=2.0)))
        target = b._target(SimpleNamespace(path="/v1/completions"), r,  # type: ignore[arg-type]
                           ForwardToRegion(r.request_id, "eu-west-1"))
        assert target is not None
        assert target.headers[SLO_CLASS_HEADER] == "chat" and target.headers[ORIGIN_HEADER] == "us-east-1"
        plain = req(1)
        target = b._target(SimpleNamespace(path="/v1/completions"), plain,  # type: ignore[arg-type]
                           ForwardToRegion(plain.request_id, "eu-west-1"))
        assert target is not None and SLO_CLASS_HEADER not in target.headers
    finally:
        await b.stop()


# ----------------------------------------------------------------------------- early rejection


def _busy_region(peers: dict[str, float] | None = None, **settings: Any) -> tuple[RegionCore, float]:
    """One replica placing one request every 0.5 s for 2 s, with 15 requests of priority 0
    still queued: a new one of that priority waits ~15 / 2 s = 7.5 s here."""
    offload = OffloadRouter("here", peers or {}, enabled=bool(peers))
    core = RegionCore("here", make_policy("least_load", PolicyContext()), offload,
                      RegionSettings(dispatch_budget=1, **settings))
    core.set_replicas(["r0"], 0.0)
    for i in range(20):
        assert core.submit(req(100 + i), 0.0) == []
    t = 0.0
    for step in range(5):
        t = step * 0.5
        core.probe("r0", ProbeSample(), t)
        placed = [a for a in core.tick(t) if isinstance(a, SendToReplica)]
        assert len(placed) == 1
        core.first_token(placed[0].request_id, t + 0.01)
        core.complete(placed[0].request_id, t + 0.02)
    return core, t + 0.02


def test_a_class_target_nothing_can_meet_is_a_429_at_once_and_nothing_else_is() -> None:
    core, now = _busy_region()
    wait = core.view.soonest_local_first_token_s(req(0), now)
    assert wait is not None and 5.0 < wait < 10.0
    actions = core.submit(req(1, ttft=1.0), now)
    assert len(actions) == 1 and isinstance(actions[0], Reject)
    assert actions[0].status == 429 and actions[0].code == "slo_unreachable"
    assert actions[0].retry_after_s is not None and actions[0].retry_after_s >= wait - 1.0 - 1e-9
    assert core.view.state_of("q1") is None  # never queued
    assert core.submit(req(2, ttft=30.0), now) == []  # a target it can still meet: queued
    assert core.submit(req(3), now) == []  # no class, no target of its own: queued
    assert core.submit(req(4, ttft=1.0, priority=10), now) == []  # nothing ahead of its priority


def test_early_rejection_off_queues_everything_and_a_peer_that_could_meet_it_saves_it() -> None:
    core, now = _busy_region(early_rejection=False)
    assert core.submit(req(1, ttft=1.0), now) == []
    core, now = _busy_region(peers={"there": 0.04})
    core.peer_heartbeat("there", _beat(), now)
    assert core.submit(req(1, ttft=1.0), now) == []  # 40 ms away with free replicas


# ----------------------------------------------------------------------------- reports and traces


def test_class_summary_judges_every_target_and_a_rejected_request_meets_none() -> None:
    import numpy as np

    from skymesh.bench.scores import class_summary

    nan = float("nan")
    arrival = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    ttft = np.array([0.5, 0.5, 1.5, nan, 0.5])
    e2e = np.array([2.5, 10.5, 3.5, nan, 2.5])
    out = np.array([21.0, 21.0, 21.0, 21.0, 21.0])
    rejected = np.array([False, False, False, True, False])
    member = np.array([True, True, True, True, False])
    chat = SloClassConfig(ttft_s=1.0, tpot_s=0.1)  # request 1: 10 s over 20 tokens, too slow
    got = class_summary(arrival, ttft, e2e, out, rejected, member, chat)
    assert got["requests"] == 4 and got["slo_attainment"] == 0.25 and got["rejected_share"] == 0.25
    assert got["ttft_mean"] == pytest.approx((0.5 + 0.5 + 1.5) / 3, abs=1e-4)
    batch = SloClassConfig(e2e_s=5.0)
    assert class_summary(arrival, ttft, e2e, out, rejected, member, batch)["slo_attainment"] == 0.5


def test_a_trace_row_may_name_its_class_and_a_mix_is_reproducible(tmp_path: Any) -> None:
    import json

    from skymesh.bench.traces import assign_slo_classes, load_mooncake

    rows = [{"timestamp": i * 100, "input_length": 600, "output_length": 8, "hash_ids": [i, 1000 + i],
             **({"slo_class": "code"} if i % 2 else {})} for i in range(40)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    trace = load_mooncake(path)
    assert [r.slo_class for r in trace[:4]] == ["", "code", "", "code"]
    mixed = assign_slo_classes(trace, {"chat": 0.7, "batch": 0.3}, seed=7)
    assert mixed == assign_slo_classes(trace, {"chat": 0.7, "batch": 0.3}, seed=7)
    assert {r.slo_class for r in mixed} == {"chat", "batch"}
    with pytest.raises(ValueError):
        assign_slo_classes(trace, {"chat": 0.0})
