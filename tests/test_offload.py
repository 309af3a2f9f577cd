"""Cross-region offload: availability from heartbeats, rules, snapshot tries, one hop."""

from __future__ import annotations

from skymesh.routing.base import RoutingRequest
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import OffloadRouter


def req(prefix: int, i: int, forwarded: bool = False) -> RoutingRequest:
    text = " ".join([f"p{prefix}w{k}" for k in range(256)] + [f"r{i}"])
    return RoutingRequest(f"{prefix}-{i}", prompt_chunk_hashes(text, 64), 257, 0.0, forwarded=forwarded)


def router(**kw: object) -> OffloadRouter:
    rtt = {"eu-west-1": 0.08, "ap-northeast-1": 0.16, "eu-central-1": 0.03}
    return OffloadRouter("us-east-1", rtt, heartbeat_interval_s=0.1, miss_limit=3, max_remote_queue=4, **kw)  # type: ignore[arg-type]


def beat(r: OffloadRouter, region: str, now: float, avail: int = 2, queue: int = 0, seq: int = 1, epoch: int = 1) -> bool:
    return r.update_peer(region, now=now, epoch=epoch, seq=seq, replicas_total=3,
                         replicas_available=avail, queue_length=queue)


def test_peer_available_needs_fresh_heartbeat_room_and_short_queue() -> None:
    r = router()
    beat(r, "eu-west-1", 0.0)
    assert r.peer_available("eu-west-1", 0.1)
    assert not r.peer_available("eu-west-1", 0.31)  # missed 3 intervals: stale
    beat(r, "eu-west-1", 1.0, avail=0, seq=2)
    assert not r.peer_available("eu-west-1", 1.0)
    beat(r, "eu-west-1", 1.1, avail=2, queue=5, seq=3)
    assert not r.peer_available("eu-west-1", 1.1)  # queue above tau
    assert abs(r.staleness_s("eu-west-1", 1.2) - 0.1) < 1e-9


def test_older_heartbeats_are_ignored() -> None:
    r = router()
    assert beat(r, "eu-west-1", 0.0, avail=2, seq=5)
    assert not beat(r, "eu-west-1", 0.1, avail=0, seq=4)
    assert r.peers["eu-west-1"].replicas_available == 2
    assert beat(r, "eu-west-1", 0.2, avail=0, seq=1, epoch=2)  # a restarted balancer


def test_each_balancer_of_a_peer_region_is_ordered_apart_and_any_keeps_it_a_target() -> None:
    r = router()
    assert r.update_peer("eu-west-1", now=0.0, balancer_id="eu-b1", epoch=9, seq=3, replicas_total=3,
                         replicas_available=1)
    # its sibling started earlier (a lower epoch): its heartbeats are its own sequence
    assert r.update_peer("eu-west-1", now=0.05, balancer_id="eu-b0", epoch=4, seq=1, replicas_total=3,
                         replicas_available=2)
    assert r.peers["eu-west-1"].replicas_available == 2
    assert not r.update_peer("eu-west-1", now=0.06, balancer_id="eu-b1", epoch=9, seq=2, replicas_total=3)
    # eu-b1 dies: eu-b0 alone keeps the region fresh
    for k in range(1, 6):
        assert r.update_peer("eu-west-1", now=0.1 * k, balancer_id="eu-b0", epoch=4, seq=1 + k,
                             replicas_total=3, replicas_available=2)
    assert r.peer_available("eu-west-1", 0.55)


def test_forwards_use_up_advertised_replicas_until_next_heartbeat() -> None:
    r = router()
    beat(r, "eu-west-1", 0.0, avail=2)
    for i in range(2):
        q = req(0, i)
        assert r.choose(q, 0.0) == "eu-west-1"
        r.on_forwarded(q, "eu-west-1", 0.0)
    assert r.choose(req(0, 9), 0.0) is None
    beat(r, "eu-west-1", 0.1, avail=1, seq=2)
    assert r.choose(req(0, 9), 0.1) == "eu-west-1"


def test_rules_restrict_targets() -> None:
    eu = OffloadRouter("eu-west-1", {"us-east-1": 0.08, "eu-central-1": 0.02},
                       allowed=lambda s, d: not s.startswith("eu-") or d.startswith("eu-"))
    eu.update_peer("us-east-1", now=0.0, seq=1, replicas_available=3)
    assert eu.choose(req(0, 0), 0.0) is None  # EU traffic never leaves the EU
    eu.update_peer("eu-central-1", now=0.0, seq=1, replicas_available=1)
    assert eu.choose(req(0, 0), 0.0) == "eu-central-1"


def test_forwarded_request_is_never_forwarded_again() -> None:
    r = router()
    beat(r, "eu-west-1", 0.0)
    assert r.choose(req(0, 0, forwarded=True), 0.0) is None


def test_snapshot_trie_prefers_where_the_prefix_went_then_rtt() -> None:
    r = router()
    for region in ("eu-west-1", "ap-northeast-1", "eu-central-1"):
        beat(r, region, 0.0, avail=5)
    # no history: nearest (smallest RTT) wins
    assert r.choose(req(7, 0), 0.0) == "eu-central-1"
    r.on_forwarded(req(7, 0), "ap-northeast-1", 0.0)
    # the prefix was sent to ap-northeast-1 before: its KV cache is warm there
    assert r.choose(req(7, 1), 0.0) == "ap-northeast-1"
    # unrelated prefix: back to RTT order
    assert r.choose(req(8, 0), 0.0) == "eu-central-1"


def test_disabled_router_never_offloads() -> None:
    r = router(enabled=False)
    beat(r, "eu-west-1", 0.0)
    assert r.choose(req(0, 0), 0.0) is None


def test_mark_unavailable_until_next_heartbeat() -> None:
    r = router()
    beat(r, "eu-west-1", 0.0, avail=3)
    r.mark_unavailable("eu-west-1")
    assert r.choose(req(0, 0), 0.0) is None
    beat(r, "eu-west-1", 0.1, avail=3, seq=2)
    assert r.choose(req(0, 0), 0.1) == "eu-west-1"


# ---------------------------------------------------------------- predicted-TTFT trigger
# default prefill cost: 300 ms per 512 uncached tokens; req() prompts are 257 tokens


def test_forward_only_when_a_peer_answers_sooner_than_the_wait_here() -> None:
    r = router()
    beat(r, "eu-west-1", 0.0, avail=2)  # free replicas, 80 ms away
    q = req(0, 0)
    # neither side holds the prefix: same prefill both ways, so the wait decides
    assert r.choose(q, 0.0, local_wait_s=0.05) is None
    assert r.choose(q, 0.0, local_wait_s=0.5) == "eu-west-1"
    r.min_gain_s = 0.5
    assert r.choose(q, 0.0, local_wait_s=0.5) is None  # not sooner by the margin asked for


def context_sent_to_eu_central(r: OffloadRouter) -> RoutingRequest:
    """eu-central-1 (30 ms away, free replicas) was sent a 256-token context; the next turn
    of that conversation, which it holds all but the last token of."""
    beat(r, "eu-central-1", 0.0, avail=2)
    r.on_forwarded(req(5, 0), "eu-central-1", 0.0)
    beat(r, "eu-central-1", 0.1, avail=2, seq=2)
    return req(5, 1)


def test_a_prefix_a_peer_holds_pulls_its_follow_up_there_and_one_held_here_keeps_it() -> None:
    r = router()
    follow_up = context_sent_to_eu_central(r)
    # idle here, but here it would prefill the whole context (~150 ms) and there only the turn
    assert r.choose(follow_up, 0.1, local_wait_s=0.0) == "eu-central-1"
    other = req(6, 0)
    r.on_local_dispatch(req(6, 1), 0.1)  # its context was served here
    assert r.choose(other, 0.1, local_wait_s=0.0) is None


def test_the_peer_stops_winning_as_our_forwards_fill_it() -> None:
    r = router()
    r.update_peer("eu-west-1", now=0.0, seq=1, replicas_total=3, replicas_available=1, placements_per_s=2.0)
    wait_here = 1.0
    sent = 0
    # distinct contexts: the prefill is the same both ways and only the waits decide
    while (target := r.choose(q := req(sent, 0), 0.0, local_wait_s=wait_here)) is not None:
        assert target == "eu-west-1"
        r.on_forwarded(q, target, 0.0)
        sent += 1
        assert sent < 10
    # one free replica, then each forward waits 1/2 s more there: the third would wait
    # 0.08 + 1.0 s there against 1.0 s here
    assert sent == 2
    assert r.peer_wait_s(r.peers["eu-west-1"]) == 1.0
    # a peer whose queue is over tau is no target however slow it is here
    r.update_peer("eu-west-1", now=0.1, seq=2, replicas_total=3, replicas_available=3, queue_length=5,
                  placements_per_s=100.0)
    assert r.choose(req(1, 0), 0.1, local_wait_s=60.0) is None


def test_a_peer_cannot_advertise_an_infinite_drain_rate() -> None:
    r = router()
    for bad in (float("inf"), float("nan"), -3.0):
        r.update_peer("eu-west-1", now=0.0, seq=1, replicas_total=3, replicas_available=0, queue_length=2,
                      placements_per_s=bad)
        assert r.peers["eu-west-1"].placements_per_s == 0.0
        assert r.peer_wait_s(r.peers["eu-west-1"]) == float("inf")  # no drain seen: never waited for
        assert r.choose(req(0, 0), 0.0, local_wait_s=30.0) is None


def test_saturated_trigger_ignores_the_wait_here() -> None:
    r = router(trigger="saturated")
    beat(r, "eu-west-1", 0.0, avail=2)
    # SkyWalker's rule: any peer with a free replica (the caller asks only when nothing
    # local is free), whatever the wait here
    assert r.choose(req(0, 0), 0.0, local_wait_s=0.0) == "eu-west-1"


def test_prefill_is_priced_by_the_refitted_ttft_model_once_attached() -> None:
    r = router()
    follow_up = context_sent_to_eu_central(r)
    # at the profile's seed (~0.59 ms/token) prefilling here costs ~150 ms, more than the RTT
    assert r.choose(follow_up, 0.1, local_wait_s=0.0) == "eu-central-1"
    model = RegionModel(prefill_s_per_token=300e-3 / 512, first_token_fixed_s=0.02)
    r.use_model(model)
    # the hardware turns out 20x faster than the seed: the whole prefill here (~8 ms)
    # beats the round trip, and the request stays
    for _ in range(400):
        model.estimator.observe(0, 4096, 0.02 + 4096 * 300e-3 / 512 / 20)
    assert r.prefill_s_per_token < 300e-3 / 512 / 10
    assert r.choose(follow_up, 0.1, local_wait_s=0.0) is None
