"""``conductor``: Mooncake's Conductor (Algorithm 1), per request. Every placement the
request may have is priced by :mod:`.pricing` — whole on the policy's pick, whole on a
decode replica that may take it now, and split from the policy's pick to each decode
replica with room for its KV — and the one with the lowest predicted TTFT among those
expected to meet both the TTFT and the TBT target wins; whole wins a tie, as the cheaper
(one replica's work, no KV moved). A split therefore happens exactly where it pays: where
decoding beside the region's prefill would break the TBT target, or where the policy's
pick cannot decode. When no placement meets both targets the request is refused (429 with
Retry-After, Algorithm 1's rejection) where the region rejects early
(``PairContext.refuse_unmet``); otherwise, and for a peer's forward, the one that misses
them least (the largest ratio of prediction to target) is taken, a split on a tie.

The prefill replica is the policy's pick, or with ``prefill_pool`` the one of every
available prefill-capable replica whose split is priced lowest (Algorithm 1's prefill
instance: its queue, the prefill of what it does not hold and the KV's move to the decode
instance). Not modelled: pulling a better cached prefix from another replica to the
prefill replica (Mooncake's ``kvcache_balancing_threshold``)."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from skymesh.routing.pairing.base import PairChoice, PairOptions, Role, does_decode, does_prefill
from skymesh.routing.pairing.pricing import Candidate, PricedRule

if TYPE_CHECKING:
    from skymesh.routing.base import Decision, ReplicaView, RoutingRequest


@dataclass(frozen=True, slots=True)
class ConductorOptions(PairOptions):
    # also price the request whole on each decode replica that may take it now (the
    # decode replica doing its own prefill, as the peers' threshold rule lets it). Off by
    # default: a prefill there lengthens the steps of every decode it holds, which the
    # price of this one request does not show (on the long-context day it let decode
    # replicas fill with prefill until no placement met the TBT target)
    whole_on_decode: bool = False
    # also price a split from every other available prefill-capable replica the request
    # may run on, not only from the policy's pick: Algorithm 1's prefill instance, by its
    # predicted TTFT with the KV's move to each decode instance (the policy's pick keeps
    # ties and the whole placement). Off by default: it overrides the policy's cache and
    # load balance with one request's price (docs/benchmarks.md, "Prefill/decode pairs")
    prefill_pool: bool = False


class Conductor(PricedRule):
    name = "conductor"
    options: ConductorOptions

    def candidates(self, req: RoutingRequest, decision: Decision, views: Mapping[str, ReplicaView],
                   roles: Mapping[str, Role], excluded: AbstractSet[str], now: float) -> list[Candidate]:
        """Every placement priced, whole ones first (the tie rule)."""
        p = decision.replica_id
        assert p is not None
        pricing = self.pricing
        decoders = self.decoders(req, views, roles, excluded)
        prefills = [p]
        if self.options.prefill_pool:
            prefills += [q for q, v in views.items()
                         if q != p and q not in excluded and v.available and v.healthy
                         and does_prefill(roles.get(q, "both"))]
        matched = pricing.matched(req, list(dict.fromkeys([*prefills, *decoders])))
        pv = views[p]
        whole: list[Candidate] = []
        if does_decode(roles.get(p, "both")) and p in decoders:
            whole.append(pricing.aggregated(req, pv, matched[p], now))
        if self.options.whole_on_decode:
            whole += [pricing.aggregated(req, views[d], matched[d], now) for d in decoders
                      if d != p and views[d].available]
        split = pricing.splits(req, [views[q] for q in prefills], [views[d] for d in decoders], matched, now)
        return whole + split

    def choose(self, req: RoutingRequest, decision: Decision, views: Mapping[str, ReplicaView],
               roles: Mapping[str, Role], excluded: AbstractSet[str], now: float) -> PairChoice | None:
        return self.best(req, self.candidates(req, decision, views, roles, excluded, now))

    def best(self, req: RoutingRequest, cands: list[Candidate]) -> PairChoice | None:
        """Algorithm 1's pick among priced placements (None: there are none)."""
        if not cands:
            return None
        ttft_slo, tbt_slo = self.pricing.targets(req)
        fit = [c for c in cands if c.meets(ttft_slo, tbt_slo)]
        if fit:
            best = min(fit, key=lambda c: c.ttft_s)  # min keeps the first of equals: whole first
            return best.choice("meets both targets")
        # ties go to a split: a whole request adds its prefill where others decode
        best = min(cands, key=lambda c: (c.violation(ttft_slo, tbt_slo), c.decode is None))
        if self.pricing.ctx.refuse_unmet and not req.forwarded:
            return best.choice("no placement meets both targets", refused=True)
        return best.choice("misses least")
