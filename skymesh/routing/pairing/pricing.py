"""The pricing every pair rule shares (Mooncake's Algorithm 1, per candidate placement):

- **TTFT** of a prefill on replica q: the region's cost model (the policy's, refitted
  online) over q's pending prefill ahead and the request's tokens q does not hold; a split
  adds moving the KV q computed that the decode replica d lacks (``KvLinks``: bytes per
  token from the model's shape, the pair's bandwidth and latency) and d's first step.
- **TBT** on the replica that decodes: the engine step it will run, by the profile's
  roofline, with its running batch, the decode legs booked there and not yet started, and
  its KV read, and how often a prefill chunk will share that step (its pending prefill
  and its recent prefill rate) — Mooncake's TBT is the mean of a request's longest 10%
  token intervals, and those are the steps a prefill chunk shares (:meth:`tbt_s`).
- **KV room** on the decode replica: its used KV (the last probe) plus the decode legs
  booked there plus this request's prompt and output must fit its capacity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from skymesh.routing.pairing.base import PairChoice, PairContext, Role, does_decode

# Mooncake's TBT: the mean of a request's longest TBT_TOP_SHARE of token intervals
TBT_TOP_SHARE = 0.1
# the TBT priced is the one a request meets with 90% chance (z of the normal's 0.9 quantile)
TBT_QUANTILE_Z = 1.2816

if TYPE_CHECKING:
    from skymesh.routing.base import ReplicaView, RoutingRequest


@dataclass(slots=True)
class Candidate:
    """One priced placement: prefill (or the whole request) on ``prefill``, decode on
    ``decode`` (None: on ``prefill`` itself)."""

    prefill: str
    decode: str | None
    ttft_s: float
    tbt_s: float
    matched_tokens: int
    transfer_s: float = 0.0

    def meets(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        return self.ttft_s <= ttft_slo_s and self.tbt_s <= tbt_slo_s

    def violation(self, ttft_slo_s: float, tbt_slo_s: float) -> float:
        """How far past its targets it is expected to end (<= 1: meets both)."""
        return max(self.ttft_s / ttft_slo_s, self.tbt_s / tbt_slo_s)

    def choice(self, reason: str, *, refused: bool = False) -> PairChoice:
        return PairChoice(self.prefill, self.decode, reason, self.matched_tokens, self.ttft_s, self.tbt_s,
                          self.transfer_s, refused)


class PairPricing:
    """Prices placements for one request at a time (the cache lookups it needs are made
    once per request: :meth:`matched`)."""

    def __init__(self, ctx: PairContext) -> None:
        self.ctx = ctx

    def targets(self, req: RoutingRequest) -> tuple[float, float]:
        """The request's (TTFT, TBT) targets: its class's, else the region's."""
        return (req.slo_ttft_s if req.slo_ttft_s is not None else self.ctx.ttft_slo_s,
                req.slo_tpot_s if req.slo_tpot_s is not None else self.ctx.tbt_slo_s)

    def matched(self, req: RoutingRequest, replica_ids: list[str]) -> dict[str, int]:
        """Prompt tokens each replica is expected to hold (the region's CacheView)."""
        model = self.ctx.model
        per = model.cache.match_per_target(req.chunk_hashes, replica_ids)
        return {rid: min(req.prompt_tokens, n * model.chunk_tokens) for rid, n in per.items()}

    def kv_fits(self, req: RoutingRequest, view: ReplicaView) -> bool:
        """``view``'s replica has room for the request's KV (prompt and output) beside what
        it holds and what is booked there. A request larger than an empty replica's KV
        always fits: no wait makes room for it (it would wait in the queue for good), and
        the replica's own limits answer it (vLLM preempts, or refuses past its context)."""
        cost = self.ctx.cost
        need = req.prompt_tokens + req.max_tokens
        if need > cost.kv_capacity_tokens:
            return True
        used = view.kv_usage * cost.kv_capacity_tokens + view.pending_decode_tokens
        return used + need <= cost.kv_capacity_tokens

    def prefill_ttft_s(self, req: RoutingRequest, view: ReplicaView, matched: int) -> float:
        return self.ctx.model.estimator.estimate(view.pending_prefill_tokens, req.prompt_tokens - matched)

    def decode_step_s(self, req: RoutingRequest, view: ReplicaView, prefill_tokens: int) -> float:
        """The step ``view``'s replica runs once this request decodes there, beside
        ``prefill_tokens`` of prefill (capped at one chunk)."""
        cost = self.ctx.cost
        batch = view.num_running + view.pending_decodes + 1
        context = view.kv_usage * cost.kv_capacity_tokens + view.pending_decode_tokens + req.prompt_tokens
        chunk = min(cost.max_num_batched_tokens - batch, prefill_tokens) if prefill_tokens > 0 else 0
        return cost.step_s(max(0, chunk), batch, int(context))

    def tbt_s(self, req: RoutingRequest, view: ReplicaView, now: float) -> float:
        """The TBT a decode on ``view``'s replica is expected to see: the mean of its
        longest 10% steps. Of its M = ``max_tokens`` steps, x carry a prefill chunk (a
        budget of tokens, or a prompt like this one's when shorter): the chunks of the
        prefill pending there now, and those of the prefill the replica is sent at its
        recent rate r (chunks per second) while it decodes, which lasts as long as its
        steps do: x = P + r (x s_chunk + (M - x) s_plain). At x >= 10% of M its longest
        tenth are all chunk steps; below, they mix with plain ones."""
        cost = self.ctx.cost
        plain = self.decode_step_s(req, view, 0)
        chunk_tokens = max(1, min(cost.max_num_batched_tokens, req.prompt_tokens))
        with_chunk = self.decode_step_s(req, view, chunk_tokens)
        steps = max(1, req.max_tokens)
        chunks_per_s = view.prefill_rate_now(now) / chunk_tokens
        room = 1.0 - chunks_per_s * (with_chunk - plain)
        if room <= 0.0:  # prefill arrives faster than the replica runs it: every step has a chunk
            return with_chunk
        x = (view.pending_prefill_tokens / chunk_tokens + chunks_per_s * steps * plain) / room
        # chunks arrive at random: price the count a decode meets in TBT_QUANTILE of cases
        # (Poisson, by its normal approximation), so a request meets its target with that
        # chance rather than with even odds at the boundary
        f = (x + TBT_QUANTILE_Z * math.sqrt(x)) / steps
        if f >= TBT_TOP_SHARE:
            return with_chunk
        return (f * with_chunk + (TBT_TOP_SHARE - f) * plain) / TBT_TOP_SHARE

    def transfer_s(self, req: RoutingRequest, prefill_id: str, decode_id: str, matched_decode: int) -> float:
        """Moving the prompt's KV ``decode_id`` lacks (it holds ``matched_decode`` tokens)
        from ``prefill_id`` over their link."""
        ctx = self.ctx
        moved = max(0, req.prompt_tokens - matched_decode) * ctx.cost.kv_bytes_per_token
        return ctx.links.transfer_s(prefill_id, decode_id, moved)

    def aggregated(self, req: RoutingRequest, view: ReplicaView, matched: int, now: float) -> Candidate:
        ttft = self.prefill_ttft_s(req, view, matched)
        return Candidate(view.replica_id, None, ttft, self.tbt_s(req, view, now), matched)

    def split(self, req: RoutingRequest, prefill: ReplicaView, decode: ReplicaView, matched_prefill: int,
              matched_decode: int, now: float) -> Candidate:
        """Prefill on ``prefill``, the KV ``decode`` lacks moved there, decode on ``decode``
        (which recomputes the prompt's last token, as vLLM's decode side does)."""
        return self.splits(req, [prefill], [decode], {prefill.replica_id: matched_prefill,
                                                      decode.replica_id: matched_decode}, now)[0]

    def splits(self, req: RoutingRequest, prefills: list[ReplicaView], decodes: list[ReplicaView],
               matched: Mapping[str, int], now: float) -> list[Candidate]:
        """:meth:`split` for every pair of a prefill in ``prefills`` and another replica in
        ``decodes`` (by prefill, then decode), each replica's own part priced once."""
        prefill_s = [(p, self.prefill_ttft_s(req, p, matched[p.replica_id])) for p in prefills]
        decode_parts = [(d, self.decode_step_s(req, d, d.pending_prefill_tokens), self.tbt_s(req, d, now))
                        for d in decodes]
        out = []
        for p, ttft_p in prefill_s:
            pid = p.replica_id
            for d, first_step, tbt in decode_parts:
                did = d.replica_id
                if did == pid:
                    continue
                transfer = self.transfer_s(req, pid, did, matched[did])
                out.append(Candidate(pid, did, ttft_p + transfer + first_step, tbt, matched[pid], transfer))
        return out


class PricedRule:
    """What every pair rule shares: its options and the region's pricing, built from
    them (``build``, the registry's factory)."""

    name = ""

    def __init__(self, options: Any, ctx: PairContext) -> None:
        self.options = options
        self.pricing = PairPricing(ctx)

    @classmethod
    def build(cls, options: Any, ctx: PairContext) -> Self:
        return cls(options, ctx)

    def plan_roles(self, configured: Mapping[str, Role], views: Mapping[str, ReplicaView],
                   now: float) -> Mapping[str, Role] | None:
        """Fixed roles: the configured ones stand."""
        return None

    def decoders(self, req: RoutingRequest, views: Mapping[str, ReplicaView], roles: Mapping[str, Role],
                 excluded: AbstractSet[str]) -> list[str]:
        """The replicas that may take the request's decode leg now: healthy, allowed,
        decode-capable, with room for its KV."""
        fits = self.pricing.kv_fits
        return [rid for rid, v in views.items()
                if rid not in excluded and v.healthy and does_decode(roles.get(rid, "both")) and fits(req, v)]


def decode_load(view: ReplicaView) -> tuple[int, float]:
    """How loaded a replica's decode side is: sequences running or booked, then KV use."""
    return view.num_running + view.pending_decodes, view.kv_usage


def least_loaded_decode(views: Mapping[str, ReplicaView], candidates: list[str]) -> str | None:
    best = min(candidates, key=lambda rid: (decode_load(views[rid]), rid), default=None)
    return best
