"""Preble's E2 scheduler (Srivatsa et al., "Preble: Efficient Distributed Prompt Scheduling
for LLM Serving", ICLR 2025, §4; reference code: WukLab/preble,
``multi_node/global_scheduler_with_time.py``).

- **Exploit** when the prompt's longest cached prefix is longer than the part it misses
  (cached share > ``hit_threshold``, ½ as in the paper): among the replicas holding that
  prefix, the one with the lowest load cost.
- **Explore** otherwise: every available replica is costed as L + P and the cheapest
  wins. L, the replica's load over a recent window (``window_s``, 3 minutes as in the
  paper): the prefill time of the prompt tokens it was given to compute in the window,
  plus the decode time still owed to its active requests (their ``max_tokens`` × its
  time per output token, learnt from completed requests as the reference code does).
  P: this request's prefill time of what that replica does not hold.

Where this departs from Preble, and why: no eviction cost term M (it needs the
replica's LRU order, which neither the routing history nor vLLM's KV events expose; the
reference code also runs with it off by default); no post-assignment rebalancing or
prefix autoscaling (they move a prefix's *future* requests between GPUs when one GPU's
load reaches 15× another's; selective pushing already keeps requests off busy replicas);
load is charged per replica per request rather than per prefix-tree node (the same sums
per replica); prefill times come from the shared online TTFT model rather than a
profiled equation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from pydantic import Field

from skymesh.routing.base import Decision, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.common import available, decide, load_key
from skymesh.routing.policies.min_ttft import EstimatingPolicy


class PrebleOptions(PolicyOptions):
    """``policy.options`` of ``preble``."""

    # exploit when the cached share of the prompt exceeds this (Preble: cached > missed)
    hit_threshold: float = Field(0.5, ge=0, le=1)
    # the load history window (Preble: 3 minutes)
    window_s: float = Field(180.0, gt=0)
    # time per output token assumed until a replica's own is observed
    decode_s_per_token: float = Field(0.03, gt=0)
    # weight of each new observation in a replica's time per output token
    decode_smoothing: float = Field(0.1, gt=0, le=1)


class PreblePolicy(EstimatingPolicy):
    name = "preble"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        o = PrebleOptions.parse(ctx.options)
        self.hit_threshold = o.hit_threshold
        self.window_s = o.window_s
        self.decode_seed = o.decode_s_per_token
        self.decode_smoothing = o.decode_smoothing
        # (dispatch time, replica, prefill seconds) of the requests in the window
        self._window: deque[tuple[float, str, float]] = deque()
        self._window_prefill: dict[str, float] = {}
        # request id -> (replica, output tokens owed); output tokens owed per replica
        self._active: dict[str, tuple[str, int]] = {}
        self._active_tokens: dict[str, int] = {}
        self._first_token_at: dict[str, float] = {}
        self._tpot: dict[str, float] = {}

    def _prefill_s(self, tokens: int) -> float:
        return self.estimator.s_per_token * max(0, tokens)

    def load_cost(self, replica_id: str) -> float:
        """L: windowed prefill plus the decode still owed to active requests (seconds)."""
        tpot = self._tpot.get(replica_id, self.decode_seed)
        return self._window_prefill.get(replica_id, 0.0) + self._active_tokens.get(replica_id, 0) * tpot

    def _expire(self, now: float) -> None:
        start = now - self.window_s
        while self._window and self._window[0][0] < start:
            _, rid, s = self._window.popleft()
            left = self._window_prefill.get(rid, 0.0) - s
            if left > 1e-12:
                self._window_prefill[rid] = left
            else:
                self._window_prefill.pop(rid, None)

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        views = available(replicas)
        if not views:
            return Decision(None, "none available")
        self._expire(now)
        matched, owners = self.best_prefix(req, views)
        if owners and req.prompt_tokens and matched / req.prompt_tokens > self.hit_threshold:
            v = min(owners, key=lambda o: (self.load_cost(o.replica_id), load_key(o)))
            self.remember(req, v, matched)
            return decide(v, "exploit", matched)
        per = self.cache.match_per_target(req.chunk_hashes, [v.replica_id for v in views])
        best: tuple[float, tuple[int, int, str]] | None = None
        pick, pick_hit = views[0], 0
        for v in views:
            hit = self.hit_tokens(req, per[v.replica_id])
            cost = self.load_cost(v.replica_id) + self._prefill_s(req.prompt_tokens - hit)
            key = (cost, load_key(v))
            if best is None or key < best:
                best, pick, pick_hit = key, v, hit
        self.remember(req, pick, pick_hit)
        est = self.estimator.estimate(pick.pending_prefill_tokens, req.prompt_tokens - pick_hit)
        return decide(pick, "explore", pick_hit, est)

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        super().on_dispatch(req, replica_id, now)
        placed = self._placed.get(req.request_id)
        uncached = placed[1] if placed is not None else req.prompt_tokens
        s = self._prefill_s(uncached)
        self._window.append((now, replica_id, s))
        self._window_prefill[replica_id] = self._window_prefill.get(replica_id, 0.0) + s
        self._active[req.request_id] = (replica_id, req.max_tokens)
        self._active_tokens[replica_id] = self._active_tokens.get(replica_id, 0) + req.max_tokens

    def on_first_token(self, req: RoutingRequest, replica_id: str, ttft_s: float, now: float) -> None:
        super().on_first_token(req, replica_id, ttft_s, now)
        if req.request_id in self._active:
            self._first_token_at[req.request_id] = now

    def on_complete(self, req: RoutingRequest, replica_id: str, ok: bool, now: float) -> None:
        super().on_complete(req, replica_id, ok, now)
        active = self._active.pop(req.request_id, None)
        first = self._first_token_at.pop(req.request_id, None)
        if active is None:
            return
        rid, tokens = active
        left = self._active_tokens.get(rid, 0) - tokens
        if left > 0:
            self._active_tokens[rid] = left
        else:
            self._active_tokens.pop(rid, None)
        if ok and first is not None and tokens > 1 and now > first:
            sample = (now - first) / (tokens - 1)
            old = self._tpot.get(rid, self.decode_seed)
            self._tpot[rid] = old + self.decode_smoothing * (sample - old)

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "window_requests": len(self._window), "active": len(self._active),
                "time_per_output_token": dict(self._tpot)}
