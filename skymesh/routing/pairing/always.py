"""``always``: every request split, as a fixed P/D deployment runs it: its prefill where
the policy put it, its decode on the least-loaded decode replica with room for its KV (a
replica of role ``both`` counts as one). Whole on the prefill replica only where no other
replica can decode it and the prefill replica may; otherwise it waits."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from skymesh.routing.pairing.base import PairChoice, PairOptions, Role, does_decode
from skymesh.routing.pairing.pricing import PricedRule, least_loaded_decode

if TYPE_CHECKING:
    from skymesh.routing.base import Decision, ReplicaView, RoutingRequest


@dataclass(frozen=True, slots=True)
class AlwaysOptions(PairOptions):
    """``pairing.rule: always`` has no knobs."""


class AlwaysSplit(PricedRule):
    name = "always"
    options: AlwaysOptions

    def choose(self, req: RoutingRequest, decision: Decision, views: Mapping[str, ReplicaView],
               roles: Mapping[str, Role], excluded: AbstractSet[str], now: float) -> PairChoice | None:
        p = decision.replica_id
        assert p is not None
        decoders = [d for d in self.decoders(req, views, roles, excluded) if d != p]
        d = least_loaded_decode(views, decoders)
        if d is not None:
            transfer = self.pricing.transfer_s(req, p, d, self.pricing.matched(req, [d])[d])
            return PairChoice(p, d, "split", decision.matched_tokens, transfer_s=transfer)
        if does_decode(roles.get(p, "both")):
            return PairChoice(p, None, "no decode replica free: whole", decision.matched_tokens)
        return None
