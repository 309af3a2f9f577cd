"""The region core: lifecycle state machine, health hysteresis, ejection, deadlines,
retries and offload — events in, actions out, no sockets and no clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.health import HealthSettings, ProbeSample
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import RETURN_GRACE_S, OffloadRouter
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import AbandonAttempt, ForwardToRegion, Reject, SendToReplica
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy
from skymesh.routing.request_state import RequestState

OK = ProbeSample()


def req(i: int, now: float = 0.0, prefix: int = 0, tokens: int = 256, forwarded: bool = False) -> RoutingRequest:
    text = " ".join([f"p{prefix}w{k}" for k in range(tokens - 8)] + [f"r{i}w{k}" for k in range(8)])
    return RoutingRequest(f"q{i}", prompt_chunk_hashes(text, 64), tokens, now, forwarded=forwarded)


def region(n: int = 3, *, policy: str = "least_load", peers: dict[str, float] | None = None,
           **settings: object) -> RegionCore:
    offload = OffloadRouter("here", peers or {}, enabled=bool(peers))
    model = RegionModel()  # the policy, offload and the discipline share it, as in the daemon
    core = RegionCore("here", make_policy(policy, PolicyContext(model=model)), offload,
                      RegionSettings(**settings), model)  # type: ignore[arg-type]
    core.set_replicas([f"r{i}" for i in range(n)], 0.0)
    return core


def probe_all(core: RegionCore, now: float = 0.0, sample: ProbeSample | None = OK) -> list[object]:
    out: list[object] = []
    for rid in list(core.view.replicas):
        out.extend(core.probe(rid, sample, now))
    return out


def sends(actions: list[object]) -> dict[str, str]:
    return {a.request_id: a.replica_id for a in actions if isinstance(a, SendToReplica)}


def test_a_request_walks_queued_placed_streaming_done() -> None:
    core = region(n=1)
    probe_all(core)
    assert core.submit(req(0), 0.0) == []
    assert core.view.state_of("q0") is RequestState.QUEUED
    assert sends(core.tick(0.0)) == {"q0": "r0"}
    assert core.view.state_of("q0") is RequestState.PLACED
    core.first_token("q0", 0.1)
    assert core.view.state_of("q0") is RequestState.STREAMING
    core.complete("q0", 0.2)
    assert core.view.state_of("q0") is None and core.view.active_requests == 0
    assert core.transitions == {("new", "queued"): 1, ("queued", "placed"): 1,
                                ("placed", "streaming"): 1, ("streaming", "done"): 1}


def test_queue_full_is_a_429_with_retry_after() -> None:
    core = region(n=1, queue_bound=1, retry_after_s=3.0)
    core.submit(req(0), 0.0)
    (rej,) = core.submit(req(1), 0.0)
    assert isinstance(rej, Reject) and rej.status == 429 and rej.retry_after_s == 3.0
    assert core.transitions[("new", "rejected")] == 1


def test_one_failed_probe_pauses_dispatch_but_does_not_eject() -> None:
    core = region(n=1, health=HealthSettings(unhealthy_threshold=3, healthy_threshold=2))
    probe_all(core)
    core.submit(req(0), 0.0)
    (placed,) = core.tick(0.0)
    core.submit(req(1), 0.0)
    assert core.probe("r0", None, 0.1) == []  # one bad probe: no abandonment...
    assert core.view.replicas["r0"].healthy
    assert core.tick(0.1) == []  # ...but no new dispatch until a good probe
    core.probe("r0", OK, 0.2)
    assert sends(core.tick(0.2)) == {"q1": "r0"}
    assert core.view.state_of(placed.request_id) is RequestState.PLACED


def test_ejection_after_n_failures_abandons_unstarted_requests_at_once() -> None:
    core = region(n=2, dispatch_budget=2, health=HealthSettings(unhealthy_threshold=3, healthy_threshold=2))
    probe_all(core)
    for i in range(4):
        core.submit(req(i, prefix=i), 0.0)
    placed = sends(core.tick(0.0))
    on_r0 = sorted(r for r, rep in placed.items() if rep == "r0")
    assert len(on_r0) == 2
    core.first_token(on_r0[0], 0.05)  # this one already streams to its client
    assert core.probe("r0", None, 0.1) == [] and core.probe("r0", None, 0.2) == []
    abandoned = core.probe("r0", None, 0.3)
    assert abandoned == [AbandonAttempt(on_r0[1], "r0")]
    assert not core.view.replicas["r0"].healthy
    assert core.view.state_of(on_r0[1]) is RequestState.QUEUED
    assert core.view.state_of(on_r0[0]) is RequestState.STREAMING  # never taken from its client
    core.probe("r1", OK, 0.3)
    # r1 is still busy with its own two: the abandoned one waits, never for r0
    core.complete(next(r for r, rep in placed.items() if rep == "r1"), 0.35)
    assert sends(core.tick(0.35)) == {on_r0[1]: "r1"}
    # an ejected replica needs healthy_threshold good probes to come back
    core.probe("r0", OK, 0.4)
    assert not core.view.replicas["r0"].healthy
    core.probe("r0", OK, 0.5)
    assert core.view.replicas["r0"].healthy and core.view.ejected_count() == 0


def test_connection_failures_count_towards_ejection() -> None:
    core = region(n=2, max_retries=5, health=HealthSettings(unhealthy_threshold=2, healthy_threshold=1))
    probe_all(core)
    core.submit(req(0), 0.0)
    first = sends(core.tick(0.0))["q0"]
    assert core.fail("q0", 0.1, reason="connect") == []  # 1 of 2: held, not ejected
    assert core.view.replicas[first].healthy
    core.probe(first, OK, 0.15)  # a good probe resets the streak
    core.submit(req(1, prefix=1), 0.2)
    for a in core.tick(0.2):
        if isinstance(a, SendToReplica) and a.replica_id == first:
            core.fail(a.request_id, 0.3, reason="connect")
    assert core.view.replicas[first].healthy  # the streak was reset: still one failure


def test_overload_answers_do_not_count_against_health() -> None:
    core = region(n=2, max_retries=9, health=HealthSettings(unhealthy_threshold=1, healthy_threshold=1))
    probe_all(core)
    core.submit(req(0), 0.0)
    rep = sends(core.tick(0.0))["q0"]
    core.fail("q0", 0.1, reason="HTTP 429", counts_against_health=False)
    assert core.view.replicas[rep].healthy


def test_retries_exhausted_is_one_502() -> None:
    core = region(n=3, max_retries=1, health=HealthSettings(unhealthy_threshold=100))
    probe_all(core)
    core.submit(req(0), 0.0)
    sends(core.tick(0.0))
    assert core.fail("q0", 0.1, reason="x") == []
    probe_all(core, 0.2)
    assert len(sends(core.tick(0.2))) == 1
    (rej,) = core.fail("q0", 0.3, reason="x")
    assert isinstance(rej, Reject) and rej.status == 502
    assert core.view.active_requests == 0
    assert all(v.in_flight == 0 and v.pending_prefill_tokens == 0 for v in core.view.replicas.values())


def test_a_failure_after_the_first_byte_fails_the_request() -> None:
    core = region(n=2)
    probe_all(core)
    core.submit(req(0), 0.0)
    core.tick(0.0)
    core.first_token("q0", 0.1)
    assert core.fail("q0", 0.2, reason="reset") == []
    assert core.view.state_of("q0") is None
    assert core.transitions[("streaming", "failed")] == 1


def test_queue_wait_deadline_is_a_504() -> None:
    core = region(n=1, max_queue_wait_s=5.0)
    core.submit(req(0, now=0.0), 0.0)  # no probe yet: nothing is available
    assert core.tick(4.9) == []
    (rej,) = core.tick(5.0)
    assert isinstance(rej, Reject) and rej.status == 504 and rej.code == "queue_timeout"
    assert core.view.queue_length == 0 and core.view.active_requests == 0


def test_a_placed_request_is_not_expired_and_may_wait_again_after_a_retry() -> None:
    core = region(n=1, max_queue_wait_s=5.0, health=HealthSettings(unhealthy_threshold=100))
    probe_all(core)
    core.submit(req(0), 0.0)
    core.tick(0.0)
    assert core.tick(6.0) == []  # placed: its deadline moves on
    assert core.view.state_of("q0") is RequestState.PLACED
    core.fail("q0", 7.0, reason="x")  # queued again: a fresh bound from now
    assert core.tick(11.9) == []  # its one replica failed it: it can only wait
    (rej,) = core.tick(12.0)
    assert isinstance(rej, Reject) and rej.status == 504


def test_offload_only_when_no_local_replica_is_available_and_never_twice() -> None:
    core = region(n=1, dispatch_budget=1, peers={"there": 0.05})
    probe_all(core)
    core.peer_heartbeat("there", HeartbeatSnapshot(4, 4, 0, 0), 0.0, epoch=1, seq=1)
    core.submit(req(0), 0.0)
    core.submit(req(1, prefix=1), 0.0)
    core.submit(req(2, prefix=2, forwarded=True), 0.0)
    acts = core.tick(0.0)
    assert sends(acts) == {"q0": "r0"}
    assert [a for a in acts if isinstance(a, ForwardToRegion)] == [ForwardToRegion("q1", "there")]
    assert core.view.state_of("q2") is RequestState.QUEUED  # came from a peer: never forwarded again
    # the peer fails before any output: served here, the peer skipped until it heartbeats
    assert core.fail("q1", 0.1, reason="HTTP 503") == []
    assert core.view.state_of("q1") is RequestState.QUEUED
    assert core.offload.candidates(0.1) == []
    assert core.view.heartbeat(0.1) == HeartbeatSnapshot(1, 0, 2, core.view.pending_prefill_tokens())


@pytest.mark.parametrize("trigger", ["predicted_ttft", "saturated"])
def test_a_region_busy_with_long_prefills_forwards_before_its_replicas_are_saturated(trigger: str) -> None:
    offload = OffloadRouter("here", {"there": 0.05}, trigger=trigger)  # type: ignore[arg-type]
    core = RegionCore("here", make_policy("least_load", PolicyContext()), offload, RegionSettings(dispatch_budget=4))
    core.set_replicas(["r0"], 0.0)
    probe_all(core)
    core.peer_heartbeat("there", HeartbeatSnapshot(4, 4, 0, 0), 0.0, epoch=1, seq=1)
    core.submit(req(0, tokens=4096), 0.0)  # ~2.4 s of prefill now ahead on r0
    assert sends(core.tick(0.0)) == {"q0": "r0"}
    core.submit(req(1, prefix=1), 0.0)
    acts = core.tick(0.0)
    assert core.view.replicas["r0"].available  # r0 could still take it ...
    if trigger == "predicted_ttft":
        # ... but 50 ms away a free replica answers seconds sooner
        assert acts == [ForwardToRegion("q1", "there")]
    else:
        assert sends(acts) == {"q1": "r0"}  # SkyWalker's rule: local while anything is free


def test_predicted_offload_keeps_residency_and_never_forwards_twice() -> None:
    offload = OffloadRouter("eu-west-1", {"us-east-1": 0.05, "eu-central-1": 0.05}, allowed=eu_stays_in_eu)
    core = RegionCore("eu-west-1", make_policy("least_load", PolicyContext()), offload, RegionSettings(dispatch_budget=4))
    core.set_replicas(["r0"], 0.0)
    probe_all(core)
    core.peer_heartbeat("us-east-1", HeartbeatSnapshot(4, 4, 0, 0), 0.0, epoch=1, seq=1)
    core.submit(req(0, tokens=4096), 0.0)
    core.tick(0.0)
    core.submit(req(1, prefix=1), 0.0)
    core.submit(req(2, prefix=2, forwarded=True), 0.0)
    # the only faster peer is outside the EU: both are served here
    assert sends(core.tick(0.0)) == {"q1": "r0", "q2": "r0"}
    core.submit(req(3, prefix=3), 0.0)
    core.submit(req(4, prefix=4, forwarded=True), 0.0)
    core.peer_heartbeat("eu-central-1", HeartbeatSnapshot(4, 4, 0, 0), 0.0, epoch=1, seq=1)
    acts = core.tick(0.0)
    assert [a for a in acts if isinstance(a, ForwardToRegion)] == [ForwardToRegion("q3", "eu-central-1")]
    assert sends(acts) == {"q4": "r0"}  # came from a peer: never forwarded again


def test_membership_change_requeues_unstarted_requests_of_a_removed_replica() -> None:
    core = region(n=2)
    probe_all(core)
    core.submit(req(0), 0.0)
    rep = sends(core.tick(0.0))["q0"]
    keep = "r1" if rep == "r0" else "r0"
    assert core.set_replicas([keep], 0.1) == [AbandonAttempt("q0", rep)]
    assert sends(core.tick(0.1)) == {"q0": keep}


def test_client_gone_in_any_state_releases_everything() -> None:
    core = region(n=1, dispatch_budget=3)
    probe_all(core)
    for i in range(3):
        core.submit(req(i, prefix=i), 0.0)
    core.tick(0.0)
    core.first_token("q1", 0.1)
    core.submit(req(9), 0.1)
    for rid in ("q0", "q1", "q2", "q9"):
        core.client_gone(rid, 0.2)
    assert core.view.active_requests == 0 and core.view.queue_length == 0 and core.view.in_flight_count == 0
    v = core.view.replicas["r0"]
    assert v.in_flight == 0 and v.pending_prefill_tokens == 0


def test_illegal_transitions_are_refused() -> None:
    core = region(n=1)
    core.submit(req(0), 0.0)
    with pytest.raises(ValueError):
        core.submit(req(0), 0.0)  # a request id is admitted once
    # complete/first_token of a queued request are not transitions the core accepts
    core.complete("q0", 0.1)
    assert core.first_token("q0", 0.1) is None
    assert core.view.state_of("q0") is RequestState.QUEUED


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["submit", "tick", "first", "done", "fail", "fail_soft", "gone", "probe_ok",
                         "probe_bad", "members", "beat", "later"]),
        st.integers(0, 11),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(events=EVENTS, policy=st.sampled_from(["least_load", "dualmap", "prefix_tree", "round_robin"]))
def test_any_event_sequence_returns_every_counter_to_zero(events: list[tuple[str, int]], policy: str) -> None:
    """Client disconnects at any point, failures before and after the first byte,
    deadlines, membership changes, peer heartbeats: once every client is gone, nothing is
    queued, in flight, booked on a replica or tracked, and every admitted request ended
    in exactly one terminal state."""
    core = region(n=3, policy=policy, peers={"there": 0.02}, dispatch_budget=2, max_queue_wait_s=1.0,
                  health=HealthSettings(unhealthy_threshold=2, healthy_threshold=1))
    now = 0.0
    submitted = 0
    members = [["r0", "r1", "r2"], ["r0", "r1"], ["r1", "r2", "r3"]]
    seen: set[int] = set()
    for ev, i in events:
        now += 0.01
        rid = f"q{i}"
        if ev == "submit" and i not in seen:
            seen.add(i)
            core.submit(req(i, now, prefix=i % 3), now)
            submitted += 1
        elif ev == "tick":
            core.tick(now)
        elif ev == "first":
            core.first_token(rid, now)
        elif ev == "done":
            core.complete(rid, now)
        elif ev == "fail":
            core.fail(rid, now, reason="x")
        elif ev == "fail_soft":
            core.fail(rid, now, reason="HTTP 429", counts_against_health=False)
        elif ev == "gone":
            core.client_gone(rid, now)
        elif ev == "probe_ok":
            probe_all(core, now)
        elif ev == "probe_bad":
            core.probe(f"r{i % 4}", None, now)
        elif ev == "members":
            core.set_replicas(members[i % 3], now)
        elif ev == "beat":
            core.peer_heartbeat("there", HeartbeatSnapshot(2, i % 3, 0, 0), now, epoch=1, seq=int(now * 1000))
        elif ev == "later":
            now += 0.6  # crosses queue-wait deadlines
        for v in core.view.replicas.values():
            assert v.in_flight >= 0 and v.pending_prefill_tokens >= 0
    for i in seen:
        core.client_gone(f"q{i}", now)
    assert core.view.active_requests == 0 and core.view.queue_length == 0 and core.view.in_flight_count == 0
    assert all(v.in_flight == 0 and v.pending_prefill_tokens == 0 for v in core.view.replicas.values())
    terminal = sum(n for (_, to), n in core.transitions.items()
                   if to in ("done", "failed", "rejected", "cancelled"))
    assert terminal == submitted


# ---------------------------------------------------------------------- residency


def eu_stays_in_eu(source: str, target: str) -> bool:
    return not source.startswith("eu-") or target.startswith("eu-")


def residency_core(region: str, homes: dict[str, str], peers: dict[str, float] | None = None) -> RegionCore:
    offload = OffloadRouter(region, peers or {}, allowed=eu_stays_in_eu, enabled=True)
    core = RegionCore(region, make_policy("least_load", PolicyContext()), offload,
                      RegionSettings(dispatch_budget=1))
    core.set_replicas(list(homes), 0.0, homes)
    probe_all(core)
    return core


def test_replicas_adopted_on_failover_never_serve_a_closed_origin() -> None:
    # eu-west-1's balancer adopted us-east-1's replica after that balancer died
    core = residency_core("eu-west-1", {"eu0": "eu-west-1", "us0": "us-east-1"})
    core.submit(req(0), 0.0)  # an EU client (this balancer's own region)
    core.submit(req(1, prefix=1), 0.0)
    placed = sends(core.tick(0.0))
    assert placed == {"q0": "eu0"}  # q1 waits for eu0 although us0 is free
    # a US client (DNS sent it here while its own balancer is down) may use both
    us = RoutingRequest("us-client", req(2, prefix=2).chunk_hashes, 256, 0.0, origin_region="us-east-1")
    core.submit(us, 0.0)
    assert sends(core.tick(0.0)) == {"us-client": "us0"}
    core.complete("q0", 0.1)
    probe_all(core, 0.1)
    assert sends(core.tick(0.1)) == {"q1": "eu0"}


def test_a_closed_origin_is_offloaded_only_to_allowed_regions_from_a_foreign_balancer() -> None:
    # an EU client reached us-east-1's balancer: its replicas are closed to it
    core = residency_core("us-east-1", {"us0": "us-east-1"}, peers={"eu-west-2": 0.08, "us-west-2": 0.02})
    for peer in ("eu-west-2", "us-west-2"):
        core.peer_heartbeat(peer, HeartbeatSnapshot(2, 2, 0, 0), 0.0, epoch=1, seq=1)
    eu = RoutingRequest("eu-client", req(0).chunk_hashes, 256, 0.0, origin_region="eu-west-1")
    core.submit(eu, 0.0)
    acts = core.tick(0.0)
    assert sends(acts) == {}  # us0 is free but closed to it
    assert [a for a in acts if isinstance(a, ForwardToRegion)] == [ForwardToRegion("eu-client", "eu-west-2")]
    # the same balancer's own clients still use us0 (another context: one the EU client
    # left at eu-west-2 would pull its follow-up there, as a peer holding it answers sooner)
    core.submit(req(1, prefix=1), 0.0)
    assert sends(core.tick(0.0)) == {"q1": "us0"}


def test_nothing_allowed_can_serve_is_an_immediate_503_not_a_long_wait() -> None:
    core = residency_core("us-east-1", {"us0": "us-east-1"})
    eu = RoutingRequest("eu-client", req(0).chunk_hashes, 256, 0.0, origin_region="eu-west-1")
    (rej,) = core.submit(eu, 0.0)
    assert isinstance(rej, Reject) and rej.status == 503 and rej.retry_after_s
    assert core.submit(req(1), 0.0) == []  # its own clients queue as usual
    empty = region(n=0)
    (rej,) = empty.submit(req(2), 0.0)
    assert isinstance(rej, Reject) and rej.status == 503
    # replicas that were healthy and are all ejected now: also 503
    core = region(n=1, health=HealthSettings(unhealthy_threshold=1))
    probe_all(core)
    core.probe("r0", None, 0.1)
    (rej,) = core.submit(req(3), 0.2)
    assert isinstance(rej, Reject) and rej.status == 503


# ---------------------------------------------------------------------- a peer region dies


def eu_client(i: int) -> RoutingRequest:
    return RoutingRequest(f"eu{i}", req(i, prefix=10 + i).chunk_hashes, 256, 0.0, origin_region="eu-west-1")


def ap_core_forwarding_eu_clients(peers: dict[str, float]) -> RegionCore:
    """ap-northeast-1's balancer holding two EU clients (its replica is closed to them):
    eu-west-1 advertised one free replica, so eu0 is forwarded there and eu1 waits for it."""
    core = residency_core("ap-northeast-1", {"ap0": "ap-northeast-1"}, peers=peers)
    core.peer_heartbeat("eu-west-1", HeartbeatSnapshot(3, 1, 0, 0), 0.0, epoch=1, seq=1)
    core.submit(eu_client(0), 0.0)
    core.submit(eu_client(1), 0.0)
    core.submit(req(2), 0.0)  # ap-northeast-1's own client
    acts = core.tick(0.0)
    assert [a for a in acts if isinstance(a, ForwardToRegion)] == [ForwardToRegion("eu0", "eu-west-1")]
    assert sends(acts) == {"q2": "ap0"}
    assert core.view.state_of("eu1") is RequestState.QUEUED
    return core


def no_capacity(actions: list[object]) -> dict[str, Reject]:
    return {a.request_id: a for a in actions
            if isinstance(a, Reject) and a.status == 503 and a.code == "no_capacity" and a.retry_after_s}


@pytest.mark.fault
def test_requests_queued_for_or_forwarded_to_a_dead_peer_get_503_at_that_moment() -> None:
    core = ap_core_forwarding_eu_clients({"eu-west-1": 0.22})
    core.submit(req(3, prefix=3), 0.0)  # an own client queued behind q2 (budget 1)
    acts = core.peer_down("eu-west-1", 0.2)
    # the forward is cut (nothing reached its client) and both EU clients are answered now:
    # no other region their residency allows is alive, and ap0 is closed to them
    assert [a for a in acts if isinstance(a, AbandonAttempt)] == [AbandonAttempt("eu0", "eu-west-1")]
    assert set(no_capacity(acts)) == {"eu0", "eu1"} and len(acts) == 3
    assert core.view.state_of("eu0") is None and core.view.state_of("eu1") is None
    assert core.transitions[("placed", "queued")] == 1 and core.transitions[("queued", "rejected")] == 2
    assert core.view.state_of("q3") is RequestState.QUEUED  # its own clients wait for ap0 as usual
    assert core.peer_down("eu-west-1", 0.3) == []  # declared once
    assert not core.offload.could_serve(0.3, "eu-west-1")
    # a new EU client gets the same answer; the peer's next heartbeat brings it back
    (rej,) = core.submit(eu_client(4), 0.3)
    assert isinstance(rej, Reject) and rej.status == 503
    core.peer_heartbeat("eu-west-1", HeartbeatSnapshot(3, 3, 0, 0), 0.4, epoch=2, seq=1)
    core.submit(eu_client(5), 0.4)
    assert ForwardToRegion("eu5", "eu-west-1") in core.tick(0.4)


@pytest.mark.fault
def test_a_peer_whose_heartbeats_time_out_is_declared_dead_by_the_tick_at_the_timeout() -> None:
    core = ap_core_forwarding_eu_clients({"eu-west-1": 0.22})
    bound = core.offload.heartbeat_interval_s * core.offload.miss_limit
    assert not no_capacity(core.tick(bound))  # fresh up to the bound: nothing happens
    assert core.view.state_of("eu0") is RequestState.PLACED and core.view.state_of("eu1") is RequestState.QUEUED
    acts = core.tick(bound + 1e-6)  # the first tick past it decides the queued one
    assert not [a for a in acts if isinstance(a, AbandonAttempt)]  # a late heartbeat cuts no forward
    assert set(no_capacity(acts)) == {"eu1"}
    assert core.view.state_of("eu0") is RequestState.PLACED
    # the dead peer's connection breaks: nowhere else may take it, 503 at once
    assert set(no_capacity(core.fail("eu0", bound + 0.01, reason="ServerDisconnectedError"))) == {"eu0"}
    assert core.view.active_requests == 1  # q2, on ap0


@pytest.mark.fault
def test_the_controller_s_word_keeps_forwards_in_flight_and_one_that_breaks_gets_503() -> None:
    core = ap_core_forwarding_eu_clients({"eu-west-1": 0.22})
    # the controller lost eu-west-1's balancer (dead, or deregistered to drain: it would
    # finish what it holds): the waiting client is answered, the forward is left alone
    acts = core.peer_down("eu-west-1", 0.2, cut_forwards=False)
    assert set(no_capacity(acts)) == {"eu1"} and len(acts) == 1
    assert core.view.state_of("eu0") is RequestState.PLACED
    # its connection breaks before any output: nowhere else may take it, 503 now (not a wait)
    assert set(no_capacity(core.fail("eu0", 0.3, reason="ServerDisconnectedError"))) == {"eu0"}
    assert core.view.active_requests == 1


@pytest.mark.fault
def test_a_dead_peer_s_requests_go_to_another_allowed_region_and_a_started_stream_stays() -> None:
    core = ap_core_forwarding_eu_clients({"eu-west-1": 0.22, "eu-central-1": 0.25})
    core.submit(eu_client(6), 0.0)
    core.peer_heartbeat("eu-west-1", HeartbeatSnapshot(3, 1, 0, 0), 0.05, epoch=1, seq=2)
    assert [a for a in core.tick(0.05) if isinstance(a, ForwardToRegion)] == [ForwardToRegion("eu1", "eu-west-1")]
    core.first_token("eu1", 0.1)  # eu1's answer is streaming to its client already
    core.peer_heartbeat("eu-central-1", HeartbeatSnapshot(3, 3, 0, 0), 0.1, epoch=1, seq=1)
    acts = core.peer_down("eu-west-1", 0.2)
    assert acts == [AbandonAttempt("eu0", "eu-west-1")]  # queued again; eu6 keeps waiting
    assert core.view.state_of("eu1") is RequestState.STREAMING  # bytes sent cannot be taken back
    forwards = [a for a in core.tick(0.2) if isinstance(a, ForwardToRegion)]
    assert forwards == [ForwardToRegion("eu0", "eu-central-1"), ForwardToRegion("eu6", "eu-central-1")]


@pytest.mark.fault
def test_a_peer_the_controller_says_is_back_is_waited_for_until_its_first_heartbeat() -> None:
    # the hand-back of a failover: eu-west-1's balancer returns; us-east-1 (its replicas
    # just left for eu-west-1) and ap-northeast-1 have not heard from it yet
    core = ap_core_forwarding_eu_clients({"eu-west-1": 0.22})
    assert set(no_capacity(core.peer_down("eu-west-1", 0.2))) == {"eu0", "eu1"}
    (rej,) = core.submit(eu_client(3), 0.3)  # nothing an EU client may use is up: 503
    assert isinstance(rej, Reject) and rej.status == 503 and rej.retry_after_s
    assert core.peer_returning("eu-west-1", 1.0, replicas=3)
    assert core.offload.snapshot_state(1.0)["eu-west-1"]["expected"]
    # between owners: an EU client waits for it instead of a 503 ...
    assert core.submit(eu_client(4), 1.0) == []
    assert not [a for a in core.tick(1.0) if isinstance(a, (Reject, ForwardToRegion))]
    # ... and is forwarded at its first heartbeat
    core.peer_heartbeat("eu-west-1", HeartbeatSnapshot(3, 3, 0, 0), 1.2, epoch=2, seq=1)
    assert ForwardToRegion("eu4", "eu-west-1") in core.tick(1.2)
    assert not core.offload.snapshot_state(1.2)["eu-west-1"]["expected"]
    # a peer heard from already, or one that owns nothing, is not waited for
    assert not core.peer_returning("eu-west-1", 1.25, replicas=3)
    assert not core.peer_returning("us-east-1", 1.25, replicas=0)


@pytest.mark.fault
def test_a_peer_said_to_be_back_but_never_heard_within_the_grace_gets_its_waiting_requests_503() -> None:
    core = ap_core_forwarding_eu_clients({"eu-west-1": 0.22})
    core.peer_down("eu-west-1", 0.2)
    core.peer_returning("eu-west-1", 1.0, replicas=3)
    assert core.submit(eu_client(4), 1.0) == []
    core.submit(req(5, prefix=5), 1.0)  # its own client, behind q2 on ap0: unaffected
    assert not no_capacity(core.tick(1.0 + RETURN_GRACE_S - 0.01))
    acts = core.tick(1.0 + RETURN_GRACE_S)
    assert set(no_capacity(acts)) == {"eu4"} and "was not heard from" in no_capacity(acts)["eu4"].message
    assert core.view.state_of("q5") is RequestState.QUEUED
    assert not no_capacity(core.tick(1.0 + RETURN_GRACE_S + 0.1))  # decided once
    (rej,) = core.submit(eu_client(6), 1.0 + RETURN_GRACE_S + 0.1)
    assert isinstance(rej, Reject) and rej.status == 503


def test_a_queue_that_cannot_drain_in_time_rejects_at_once_with_retry_after() -> None:
    core = region(n=1, dispatch_budget=1, max_queue_wait_s=10.0)
    probe_all(core)
    assert core.view.expected_queue_wait_s(0.0) is None  # no rate yet: never rejects blind
    core.submit(req(0), 0.0)
    assert sends(core.tick(0.0)) == {"q0": "r0"}  # one placement in the last second
    assert core.view.expected_queue_wait_s(0.5) is None  # too little history yet
    outcomes = []
    for i in range(1, 40):
        expected = core.view.expected_queue_wait_s(1.0)
        got = core.submit(req(i, prefix=i), 1.0)
        outcomes.append((core.view.queue_length > 0 and expected is not None and expected > 10.0, bool(got)))
        if got:
            (rej,) = got
            assert isinstance(rej, Reject) and rej.status == 429 and rej.code == "queue_wait"
            assert rej.retry_after_s is not None and rej.retry_after_s > 0
    # rejected exactly when the queue ahead could not drain within the bound
    assert all(should == rejected for should, rejected in outcomes)
    assert any(rejected for _, rejected in outcomes) and not all(rejected for _, rejected in outcomes)
    # without a bound (the simulator's goodput sweeps) it queues
    unbounded = region(n=1, dispatch_budget=1, max_queue_wait_s=None)
    probe_all(unbounded)
    unbounded.submit(req(0), 0.0)
    unbounded.tick(0.0)
    assert all(unbounded.submit(req(i, prefix=i), 5.0) == [] for i in range(1, 40))


def test_offload_prices_prefill_with_the_policy_s_refitted_model() -> None:
    # a policy that learns a TTFT model refits the region model's, which offload reads; one
    # that learns none leaves it (and offload) on the profile's seed
    learning = region(policy="dualmap", peers={"there": 0.05})
    assert learning.view.policy.estimator is learning.model.estimator  # type: ignore[attr-defined]
    assert learning.offload.model is learning.model
    learning.view.policy.estimator.observe(0, 1000, 5.0)  # type: ignore[attr-defined]
    learning.view.policy.estimator.observe(0, 2000, 10.0)  # type: ignore[attr-defined]
    assert learning.offload.prefill_s_per_token == learning.model.estimator.s_per_token
    assert learning.offload.prefill_s_per_token != learning.offload.seed_prefill_s_per_token
    fixed = region(policy="least_load", peers={"there": 0.05})
    assert fixed.offload.model is fixed.model
    assert fixed.offload.prefill_s_per_token == fixed.offload.seed_prefill_s_per_token


def _serve_placed(core: RegionCore, actions: list[object], now: float, ttft_s: float = 0.05) -> int:
    """Every request just sent to a replica gets its first token ``ttft_s`` later and
    completes at once (a quick small answer). Returns how many there were."""
    placed = sends(actions)
    for request_id in placed:
        core.first_token(request_id, now + ttft_s)
        core.complete(request_id, now + ttft_s)
    return len(placed)


@pytest.mark.fault
def test_a_burst_after_a_quiet_spell_is_served_not_refused() -> None:
    # measured on main at 1da6a04 (make run, configs/local.yaml): after 45-90 s without
    # traffic, 18-29 of 30 small requests got 429 "the balancer's queue would take
    # ~496,067,694 s": the wait was priced at a placement rate that decays to ~0 while idle
    core = region(n=3, max_queue_wait_s=60.0)
    now = 0.0
    for i in range(100):  # 10 s of steady traffic, 10 requests a second, all served
        now = i * 0.1
        probe_all(core, now)
        assert core.submit(req(i, now, prefix=i), now) == []
        assert _serve_placed(core, core.tick(now), now) == 1
    for second in range(1, 91):  # 90 s without a request; the probes go on
        now = 10.0 + second
        probe_all(core, now)
        assert core.tick(now) == []
    # 30 requests arrive together, before the dispatch loop runs again
    refused = [a for i in range(30) for a in core.submit(req(1000 + i, now, prefix=1000 + i), now)]
    assert refused == []
    # the wait is still judged (by what the replicas can take), and it is short
    expected = core.view.expected_queue_wait_s(now)
    assert expected is not None and expected < 60.0
    served = 0
    for step in range(50):  # and they are served, well within the bound
        t = now + step * 0.1
        probe_all(core, t)
        served += _serve_placed(core, core.tick(t), t)
    assert served == 30 and core.view.active_requests == 0
    assert core.transitions[("new", "rejected")] == 0 and core.transitions[("queued", "rejected")] == 0


def test_a_queue_saturated_replicas_cannot_drain_is_refused_at_once_with_a_bounded_retry_after() -> None:
    core = region(n=2, dispatch_budget=1, max_queue_wait_s=30.0, retry_after_s=2.0)
    probe_all(core, 0.0)
    for i in range(80):  # no placement seen yet: nothing is refused blind
        assert core.submit(req(i, prefix=i), 0.0) == []
    # saturated replicas (requests waiting in their own queues): r0 has room for one more
    # every 2 s, r1 every 4 s, then neither for the last 4 s
    placed = 0
    for step in range(13):
        now = float(step)
        for k, rid in enumerate(sorted(core.view.replicas)):
            room = step < 9 and step % (2 * (k + 1)) == 0
            core.probe(rid, ProbeSample(num_running=8, num_waiting=0 if room else 4), now)
        placed += _serve_placed(core, core.tick(now), now, ttft_s=0.5)
    assert 0 < placed < 10 and core.view.queue_length > 70
    # the replicas can take nothing more by their own account: only the measured rate counts
    assert core.local.sustainable_dispatch_rate(now, core.view.first_token_s()) == 0.0
    expected = core.view.expected_queue_wait_s(now)
    assert expected is not None and expected > 3 * 30.0  # far over the bound
    (rej,) = core.submit(req(500, now), now)
    assert isinstance(rej, Reject) and rej.status == 429 and rej.code == "queue_wait"
    assert rej.retry_after_s is not None and 0.0 < rej.retry_after_s <= 30.0  # never past one bound
    assert core.view.state_of("q500") is None  # not queued to a 504


def test_a_peers_forward_queued_here_does_not_put_the_own_queue_under_skywalkers_rule() -> None:
    # issue 36: every forward names the sender's region as its origin; counting such a
    # request as one residency restricts made the region offer its own queue by the
    # saturated rule (to any peer with a free replica) past the predicted-TTFT trigger
    core = region(n=1, peers={"far": 4.0}, dispatch_budget=1)
    now = 0.0
    for i in range(5):  # 2 s of placements: the region has a drain rate to predict with
        now = i * 0.5
        probe_all(core, now)
        core.submit(req(i, now, prefix=i), now)
        (rid,) = sends(core.tick(now))
        core.first_token(rid, now + 0.1)
        core.complete(rid, now + 0.2)
    now = 2.5
    probe_all(core, now)
    core.peer_heartbeat("far", HeartbeatSnapshot(4, 4, 0, 0), now, epoch=1, seq=1)
    core.submit(req(50, now, prefix=50), now)  # takes r0's budget
    assert len(sends(core.tick(now))) == 1
    # a request the peer forwarded here (its origin: the sender, whose replicas it may use)
    from_peer = RoutingRequest("from-far", req(60, prefix=60).chunk_hashes, 256, now,
                               forwarded=True, origin_region="far")
    assert core.submit(from_peer, now) == []
    core.submit(req(70, now, prefix=70), now)  # an own client, r0 busy
    acts = core.tick(now)
    # 4 s away the peer cannot answer sooner than r0 frees: both stay queued here
    assert [a for a in acts if isinstance(a, ForwardToRegion)] == []
    assert core.view.state_of("q70") is RequestState.QUEUED and core.view.state_of("from-far") is RequestState.QUEUED
