"""Two balancers of one region over the real sibling channel (gRPC on loopback; the
balancer is the stand-in behind the services' ports with a real region core and the
real RegionFleet): they split every replica's push budget with no unit held twice over
one stream, skip messages with nothing new while keepalives keep both alive, each learns
what the other placed, a sibling that stops keeps its units until the controller's
topology calls it dead, and a message past its bounds is dropped."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import pytest

from skymesh.balancer.services import PeerMesh
from skymesh.balancer.sibling_link import MAX_PLACEMENTS_PER_MESSAGE, from_proto
from skymesh.proto_gen import mesh_pb2
from skymesh.routing.base import RoutingRequest
from skymesh.routing.health import ProbeSample
from skymesh.routing.push_shares import Unit
from skymesh.routing.region_actions import SendToReplica
from tests.balancer_standin import StandInBalancer
from tests.mesh_helpers import free_port

pytestmark = pytest.mark.timeout(60)

INTERVAL_S = 0.02
REPLICAS = ["r0", "r1", "r2"]


def member(name: str, port: int, siblings: dict[str, int]) -> StandInBalancer:
    b = StandInBalancer("us", port, {}, INTERVAL_S, controller_listen=f"127.0.0.1:{port}", member=name,
                        sibling_ports=siblings, sibling_dead_after_s=0.3)
    now = asyncio.get_running_loop().time()
    b.core.set_replicas(REPLICAS, now)
    for rid in REPLICAS:
        b.core.probe(rid, ProbeSample(num_running=0, num_waiting=0, kv_usage=0.0), now)
    return b


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not check():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.01)


def units(b: StandInBalancer) -> set[Unit]:
    assert b.core.siblings is not None
    return set(b.core.siblings.shares.held)


@contextlib.asynccontextmanager
async def two_members() -> AsyncIterator[tuple[StandInBalancer, StandInBalancer, PeerMesh, PeerMesh]]:
    """Siblings us-a and us-b over the real channel on loopback (each mesh stops at the end,
    again if a test stopped it already)."""
    pa, pb = free_port(), free_port()
    a = member("a", pa, {"us-b": pb})
    b = member("b", pb, {"us-a": pa})
    ma, mb = PeerMesh(a, a), PeerMesh(b, b)
    await ma.start()
    await mb.start()
    try:
        yield a, b, ma, mb
    finally:
        await ma.stop()
        await mb.stop()


async def test_two_siblings_split_the_budget_share_placements_and_outlive_each_other() -> None:
    async with two_members() as (a, b, ma, mb):
        budget = a.core.settings.dispatch_budget
        every = {Unit(r, i) for r in REPLICAS for i in range(budget)}
        await until(lambda: units(a) | units(b) == every, "every unit held")
        assert not units(a) & units(b)
        assert units(a) and units(b)  # both hold some: the homes split them

        # quiet: messages with nothing new are skipped, keepalives keep both alive
        assert ma.sibling_link is not None and mb.sibling_link is not None
        await until(lambda: ma.sibling_link is not None and ma.sibling_link.skipped_quiet > 20, "quiet ticks skipped")
        assert units(a) | units(b) == every and not units(a) & units(b)
        # one stream for the pair: us-a dials us-b, us-b dials nobody
        assert list(ma.sibling_link._dialing) == ["us-b"] and not mb.sibling_link._dialing

        # a places a request: b's routing history learns where it went
        now = asyncio.get_running_loop().time()
        req = RoutingRequest("q1", (11, 22, 33), 300, now)
        a.core.submit(req, now)
        sent = [x for x in a.core.tick(now) if isinstance(x, SendToReplica)]
        assert len(sent) == 1
        chosen = sent[0].replica_id
        await until(lambda: b.core.siblings is not None and b.core.siblings.placements_applied >= 1,
                    "b applied a's placement")
        assert b.core.model.cache.match_per_target((11, 22, 33), [chosen])[chosen] == 3

        # a stops: silence alone hands b nothing of a's (a stalled a may come back holding
        # them); the leases a granted end on b's clock
        held_by_a = units(a)
        await ma.stop()
        await asyncio.sleep(2 * (1.0 + 0.25))  # past a whole lease and the skew margin
        assert units(b) == every - held_by_a
        # the controller's topology calls a dead: b takes a's home units
        b.fleet.topology_members([
            SimpleNamespace(balancer_id="us-a", alive=False, epoch=1, http_url="", grpc_address=f"127.0.0.1:{a.grpc_port}"),
            SimpleNamespace(balancer_id="us-b", alive=True, epoch=1, http_url="", grpc_address=f"127.0.0.1:{b.grpc_port}"),
        ], asyncio.get_running_loop().time())
        await until(lambda: units(b) == every, "b took a's units")


def test_a_sibling_message_past_its_bounds_is_refused_before_it_reaches_the_core() -> None:
    pb = mesh_pb2.SiblingState(region="us", balancer_id="us-x", epoch=1, seq=1)
    pb.placements.extend(mesh_pb2.PlacementRecord(replica_id="r0", chunk_hashes=[1])
                         for _ in range(MAX_PLACEMENTS_PER_MESSAGE + 1))
    with pytest.raises(ValueError, match="past its bounds"):
        from_proto(pb, 0.0)
    ok = mesh_pb2.SiblingState(region="us", balancer_id="us-x", epoch=1, seq=1,
                               placements=[mesh_pb2.PlacementRecord(replica_id="r0", chunk_hashes=[1, 2], age_s=0.5)])
    msg = from_proto(ok, 10.0)
    assert msg.placements[0].at == pytest.approx(9.5) and msg.placements[0].chunk_hashes == (1, 2)


def test_a_replica_s_load_crosses_the_wire_whole() -> None:
    from skymesh.balancer.sibling_link import to_proto
    from skymesh.routing.push_shares import ShareState
    from skymesh.routing.siblings import SiblingLoad, SiblingMessage

    shares = ShareState(balancer_id="us-b1", epoch=2, seq=7, queue_length=1, wants={"r1": 2}, held=frozenset(),
                        claims=frozenset(), grants={}, seen={})
    loads = {"r0": SiblingLoad(3, 1, 4096), "r1": SiblingLoad(0, 0, 0)}
    sent = SiblingMessage(region="us", shares=shares, sent_at=0.0, pending_prefill_tokens=4096,
                          placements_per_s=0.0, loads=loads, placements=())
    got = from_proto(mesh_pb2.SiblingState.FromString(to_proto(sent).SerializeToString()), 1.0)
    assert got.loads == loads and got.shares.wants == {"r1": 2}


def test_a_message_goes_at_once_only_for_what_a_sibling_waits_for() -> None:
    from skymesh.balancer.sibling_link import _Sent, _why_now

    u0, u1 = Unit("r0", 0), Unit("r0", 1)
    sent = _Sent(held=frozenset({u0}), claims=frozenset({u1}), grants=frozenset(), wants=frozenset({"r1"}), draining=False)
    assert _why_now(sent, None, False) == "first"
    assert _why_now(sent, sent, False) is None
    assert _why_now(sent, sent, True) == "answer"  # a sibling's claim heard since: our word
    # the claim already went out: it rides later messages, no message of its own
    held_more = dataclasses.replace(sent, held=frozenset({u0, u1}), claims=frozenset())
    assert _why_now(held_more, sent, False) is None  # a unit taken: nobody waits for it
    assert _why_now(dataclasses.replace(sent, claims=frozenset({u1, Unit("r1", 0)})), sent, False) == "claim"
    assert _why_now(dataclasses.replace(sent, held=frozenset()), sent, False) == "gave_up"
    assert _why_now(dataclasses.replace(sent, grants=frozenset({(u0, "b")})), sent, False) == "grants"
    assert _why_now(dataclasses.replace(sent, wants=frozenset({"r1", "r2"})), sent, False) == "wants"
    assert _why_now(dataclasses.replace(sent, wants=frozenset()), sent, False) is None  # a want gone
    assert _why_now(dataclasses.replace(sent, draining=True), sent, False) == "draining"


def test_a_shared_page_is_dated_by_its_arrival_less_its_age_and_a_bad_one_is_dropped() -> None:
    from skymesh.balancer.prober import ProbeResult
    from skymesh.balancer.sibling_link import page_from_proto, page_to_proto

    res = ProbeResult(healthy=True, num_running=3, num_waiting=1, kv_usage=0.4, prefix_queries=100.0,
                      prefix_hits=60.0, sent_at=100.0)
    pb = mesh_pb2.ReplicaPage.FromString(page_to_proto(("r0", res), built_at=100.25).SerializeToString())
    got = page_from_proto(pb, received_at=7.0)  # the receiver's own clock, any origin
    assert got is not None
    rid, page = got
    assert rid == "r0" and page.sent_at == pytest.approx(6.75)
    assert (page.healthy, page.num_running, page.num_waiting, page.kv_usage, page.prefix_hits) == (True, 3, 1, 0.4, 60.0)
    silent = ProbeResult(healthy=False, error="TimeoutError", timed_out=True, sent_at=99.0)
    _, page = page_from_proto(page_to_proto(("r1", silent), built_at=100.0), received_at=7.0) or ("", silent)
    assert not page.healthy and page.timed_out and page.error == "TimeoutError"
    for bad in (mesh_pb2.ReplicaPage(replica_id="r0", kv_usage=float("nan")),
                mesh_pb2.ReplicaPage(replica_id="r0", age_s=-1.0),
                mesh_pb2.ReplicaPage(replica_id="", healthy=True)):
        assert page_from_proto(bad, 7.0) is None


async def test_pages_a_member_scraped_reach_its_sibling_at_once() -> None:
    from skymesh.balancer.prober import ProbeResult

    async with two_members() as (a, b, ma, mb):
        assert ma.sibling_link is not None
        await until(lambda: ma.sibling_link is not None and ma.sibling_link.skipped_quiet > 5, "a quiet channel")
        scraped_at = asyncio.get_running_loop().time()
        a.pages_out = [("r1", ProbeResult(healthy=True, num_running=5, sent_at=scraped_at))]
        for listener in a.dispatch_listeners:  # a probe round ends in a dispatch round
            listener()
        await until(lambda: bool(b.pages_in), "b got a's page")
        ((rid, page),) = b.pages_in
        assert rid == "r1" and page.num_running == 5
        assert page.sent_at is not None and page.sent_at >= scraped_at  # no older than it was (one clock here)
        assert page.sent_at <= asyncio.get_running_loop().time()
        sent_for_pages = ma.sibling_link.sent_because.get("pages", 0)
        # the same page again shows no change: it rides the next keepalive, no message of its own
        b.pages_in.clear()
        a.pages_out = [("r1", ProbeResult(healthy=True, num_running=5, sent_at=asyncio.get_running_loop().time()))]
        for listener in a.dispatch_listeners:
            listener()
        await until(lambda: bool(b.pages_in), "b got the unchanged page")
        assert ma.sibling_link.sent_because.get("pages", 0) == sent_for_pages
