"""``threshold``: the peers' rule (vllm-router, llm-d's ``nonCachedTokens``, Dynamo's
conditional disaggregation). The decode replica is the least-loaded one with room for the
request's KV; when the prompt tokens it does not hold are fewer than ``threshold_tokens``
and it may take the request now, it runs the whole request (its own prefill is short);
otherwise the request is split, its prefill where the policy put it."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from skymesh.routing.pairing.base import PairChoice, PairOptions, Role
from skymesh.routing.pairing.pricing import PricedRule, least_loaded_decode

if TYPE_CHECKING:
    from skymesh.routing.base import Decision, ReplicaView, RoutingRequest


@dataclass(frozen=True, slots=True)
class ThresholdOptions(PairOptions):
    # split when the decode replica would prefill this many tokens or more (256: the figure
    # cited for vllm-router's conditional split; the vllm-router 0.1.17 measured here splits
    # every request in its P/D mode, docs/benchmarks.md)
    threshold_tokens: int = 256

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0:
            raise ValueError("threshold_tokens must be >= 0")


class ThresholdSplit(PricedRule):
    name = "threshold"
    options: ThresholdOptions

    def choose(self, req: RoutingRequest, decision: Decision, views: Mapping[str, ReplicaView],
               roles: Mapping[str, Role], excluded: AbstractSet[str], now: float) -> PairChoice | None:
        p = decision.replica_id
        assert p is not None
        pricing = self.pricing
        decoders = self.decoders(req, views, roles, excluded)
        d = least_loaded_decode(views, decoders)
        if d is None:
            return None
        matched = pricing.matched(req, [d])[d]
        if d == p or (req.prompt_tokens - matched < self.options.threshold_tokens and views[d].available):
            return PairChoice(d, None, "short uncached suffix: whole on the decode replica", matched)
        return PairChoice(p, d, "split", decision.matched_tokens, transfer_s=self.pricing.transfer_s(req, p, d, matched))
