"""Offload selection on its own (skymesh/routing/offload_selection.py): the queue, its
drain rate and the peers in, ``(request, region)`` pairs out; the queue is never changed."""

from __future__ import annotations

from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.dispatcher import BalancerCore
from skymesh.routing.drain_rate import DrainRate
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import OffloadRouter, OffloadTrigger
from skymesh.routing.offload_selection import OffloadSelection
from skymesh.routing.registry import make_policy


def req(i: int, *, forwarded: bool = False) -> RoutingRequest:
    text = " ".join(f"p{i}w{k}" for k in range(256))
    return RoutingRequest(f"q{i}", prompt_chunk_hashes(text, 64), 256, 0.0, forwarded=forwarded)


def parts(trigger: OffloadTrigger, *, replicas: int = 2, available: bool = False,
          forbidden: frozenset[str] = frozenset()) -> tuple[BalancerCore, DrainRate, OffloadRouter, OffloadSelection]:
    """A queue whose replicas are healthy and, unless ``available``, saturated (requests
    waiting in their own queues); one peer, 50 ms away, with three free replicas."""
    queue = BalancerCore(make_policy("least_load", PolicyContext(model=RegionModel())), dispatch_budget=1)
    queue.set_replicas([f"r{i}" for i in range(replicas)])
    for rid in queue.replicas:
        queue.update_replica(rid, healthy=True, num_waiting=0 if available else 4)
    offload = OffloadRouter("here", {"there": 0.05}, trigger=trigger)
    offload.update_peer("there", now=0.0, epoch=1, seq=1, replicas_total=3, replicas_available=3,
                        placements_per_s=50.0)
    drain = DrainRate(queue, offload)
    return queue, drain, offload, OffloadSelection(queue, drain, offload, lambda r: forbidden)


def test_saturated_replicas_send_the_queue_to_a_peer_with_room_and_leave_it_queued() -> None:
    queue, _, _, selection = parts("saturated")
    for i in range(5):
        queue.submit(req(i))
    queue.submit(req(9, forwarded=True))  # came from a peer: never forwarded again
    chosen = selection.saturated(0.0, restricted=False)
    # the peer's three free replicas take three; the rest wait here
    assert [(r.request_id, region) for r, region in chosen] == [("q0", "there"), ("q1", "there"), ("q2", "there")]
    assert queue.queue_length == 6  # the coordinator takes them out, not the selection


def test_nothing_is_offloaded_while_a_local_replica_is_available() -> None:
    queue, _, _, selection = parts("saturated", available=True)
    queue.submit(req(0))
    assert selection.saturated(0.0, restricted=False) == []


def test_the_predicted_trigger_waits_for_a_drain_rate_before_judging_the_queue_beyond_free_slots() -> None:
    queue, _, _, selection = parts("predicted_ttft")
    for i in range(20):
        queue.submit(req(i))
    assert selection.predicted_ttft(0.0) == []  # no free slot, no rate: nothing predicted
    # the saturated rule stands in while there is no rate to predict with
    assert len(selection.saturated(0.0, restricted=False)) == 3


def test_the_predicted_trigger_forwards_what_a_peer_answers_sooner() -> None:
    queue, drain, offload, selection = parts("predicted_ttft")
    for i in range(20):
        queue.submit(req(i))
    offload.update_peer("there", now=2.0, epoch=1, seq=2, replicas_total=3, replicas_available=3,
                        placements_per_s=50.0)  # fresh at 2 s
    for k in range(3):  # one placement a second, the queue never empty: a slow drain here
        drain.placed(float(k))
    chosen = selection.predicted_ttft(2.0)
    assert chosen and all(region == "there" for _, region in chosen)
    assert [r.request_id for r, _ in chosen] == [f"q{i}" for i in range(len(chosen))]  # head first


def test_the_soonest_local_first_token_reads_only_replicas_the_request_may_use() -> None:
    queue, _, offload, selection = parts("predicted_ttft", available=True)
    queue.replicas["r0"].pending_prefill_tokens = 100
    queue.replicas["r1"].pending_prefill_tokens = 1000
    assert selection.soonest_local_first_token_s(req(0), 0.0) == offload.prefill_s_per_token * 100
    queue, _, offload, only_r1 = parts("predicted_ttft", available=True, forbidden=frozenset({"r0"}))
    queue.replicas["r1"].pending_prefill_tokens = 1000
    assert only_r1.soonest_local_first_token_s(req(0), 0.0) == offload.prefill_s_per_token * 1000
    _, _, _, none_allowed = parts("predicted_ttft", available=True, forbidden=frozenset({"r0", "r1"}))
    assert none_allowed.soonest_local_first_token_s(req(0), 0.0) is None
