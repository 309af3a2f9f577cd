"""Limits that hold across a region's balancers (docs/routing.md, "A region is a fleet"):
each balancer's gate charges what its siblings took of a key's budgets, told in every
sibling message. A key limited to R requests a minute spread over two or three gates
gets R within 10% whether usage goes every interval or only with the keepalives (the
daemon's cadence when the push budget is quiet); without the exchange it would get N times R."""

from __future__ import annotations

import math

import pytest

from skymesh.balancer.gate import ClientGate
from tests.test_reload import BASE, answer, edited, gate_for, sha

PER_MINUTE = 120
# the daemon sends key usage with its next sibling message: at once when the push budget
# moved (siblings.interval_s apart at the most), else with the keepalive (keepalive_s)
INTERVAL_S = 0.02
KEEPALIVE_S = 0.25


def gates(n: int, share: bool) -> list[ClientGate]:
    keys = [{"name": "alice", "sha256": sha("sk-alice"),
             "limits": {"requests_per_second": PER_MINUTE / 60.0, "request_burst": 2,
                        "prompt_tokens_per_minute": 60_000}}]
    cfg = edited(BASE, **{"client_auth.keys": keys})
    return [gate_for(cfg) for _ in range(n)]


def admitted_in_a_minute(n: int, share: bool, offered_per_s: float = 20.0, cadence_s: float = INTERVAL_S) -> int:
    """A client offering ``offered_per_s`` requests a second, each to the next balancer
    (the region's entry spreads connections), for 60 s; siblings exchange usage every
    interval when ``share``."""
    gs = gates(n, share)
    admitted = 0
    next_message = cadence_s
    step = 1.0 / offered_per_s
    for i in range(math.floor(60.0 / step)):
        now = i * step
        while share and next_message <= now:
            usage = [g.take_usage() for g in gs]
            for k, g in enumerate(gs):
                for j, u in enumerate(usage):
                    if j != k:
                        g.charge_siblings(u, now)
            next_message += cadence_s
        if answer(gs[i % n], "sk-alice", now) == 200:
            admitted += 1
    return admitted


@pytest.mark.parametrize("cadence_s", [INTERVAL_S, KEEPALIVE_S])
@pytest.mark.parametrize("n", [2, 3])
def test_a_key_gets_its_limit_within_ten_percent_through_every_balancer(n: int, cadence_s: float) -> None:
    one = admitted_in_a_minute(1, share=False)
    assert abs(one - PER_MINUTE) <= 0.1 * PER_MINUTE
    shared = admitted_in_a_minute(n, share=True, cadence_s=cadence_s)
    assert abs(shared - PER_MINUTE) <= 0.1 * PER_MINUTE, shared
    # the exchange is what holds it: apart, each balancer grants the whole limit
    apart = admitted_in_a_minute(n, share=False)
    assert apart >= 0.9 * n * PER_MINUTE


def test_usage_from_a_sibling_is_bounded_to_configured_keys_and_sane_values() -> None:
    (gate,) = gates(1, share=True)
    gate.charge_siblings({"mallory": (1e9, 1e9), "alice": (float("nan"), -5.0)}, 0.0)
    assert answer(gate, "sk-alice", 0.0) == 200  # nothing of that was charged to alice
    gate.charge_siblings({"alice": (1e9, 0.0)}, 0.0)
    # a sibling's huge claim empties the bucket, no further than one burst below zero
    assert answer(gate, "sk-alice", 0.5) == 429
    assert answer(gate, "sk-alice", 3.1) == 200
