"""One request's way through the balancer after admission: wait for the region core's
word, proxy an attempt (a local replica or a peer region), report the outcome back to the
core, and count it (retries, mid-stream failures, SLO classes, cache predictions).

:class:`RequestFlow` owns the handlers' waiters and carries out the core's actions
(``apply``); the request's intake (skymesh/balancer/request_intake.py
:class:`~skymesh.balancer.request_intake.RequestIntake`) parses and admits it, submits it
to the core and hands it to :meth:`RequestFlow.serve`. The headers of an attempt and of the
answer are built here too (:func:`replica_target`, :func:`peer_target`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.pd_legs import checked_params, decode_body, prefill_leg, replica_hosts
from skymesh.balancer.proxy import (
    FINAL_ANSWER_HEADER,
    AttemptOutcome,
    AttemptTarget,
    Outcome,
    Upstream,
    UpstreamTimeouts,
    attempt,
)
from skymesh.balancer.ratelimit import retry_after_header
from skymesh.balancer.slo_class_lookup import SLO_CLASS_HEADER
from skymesh.balancer.upstream_http import UpstreamPool
from skymesh.balancer.usage import reported_cached_tokens, reported_completion_tokens
from skymesh.cache_prediction import judge_prediction
from skymesh.edge.openai_errors import error_response
from skymesh.routing.base import RoutingRequest
from skymesh.routing.harm import HARMFUL_REQUEST_CODE
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import (
    AbandonAttempt,
    Action,
    ForwardToRegion,
    Reject,
    SendToReplica,
)
from skymesh.runtime.clock import loop_clock
from skymesh.slo_judge import SloClass, missed_targets

if TYPE_CHECKING:  # imported only when tracing is on (server.py)
    from skymesh.balancer.tracing import AttemptSpan, RequestTrace

log = logging.getLogger("skymesh.balancer")

HOP_HEADER = "X-Skymesh-Hop"
TOKEN_HEADER = "X-Skymesh-Peer-Token"
ORIGIN_HEADER = "X-Skymesh-Origin-Region"

# where an attempt for a placement goes; None: the replica left membership, or the peer
# has no peer listener
TargetFor = Callable[[web.Request, RoutingRequest, SendToReplica | ForwardToRegion], AttemptTarget | None]


def replica_target(base_url: str, request: web.Request, session: aiohttp.ClientSession, *,
                   region: str, replica_id: str, request_id: str, pool: UpstreamPool | None = None) -> AttemptTarget:
    """An attempt on one of this region's replicas, and the headers of its answer; sent by
    ``pool`` (the lean client) when the replica's URL is plain http, else by ``session``."""

    def local_headers(upstream: Upstream) -> dict[str, str]:
        return {
            "Content-Type": upstream.headers.get("Content-Type", "application/json"),
            "X-Skymesh-Region": region,
            "X-Skymesh-Replica": replica_id,
            "X-Skymesh-Offloaded": "0",
            "X-Skymesh-Path": region,
            "X-Request-Id": request_id,
        }

    url = base_url + request.path
    return AttemptTarget(url, {"Content-Type": "application/json"}, session, local_headers,
                         pool=pool if pool is not None and pool.serves(url) else None)


def peer_target(peer_url: str, request: web.Request, session: aiohttp.ClientSession, *, region: str,
                peer_region: str, peer_token: str, req: RoutingRequest, client_tls: ssl.SSLContext | None,
                server_hostname: str | None) -> AttemptTarget:
    """A forward to ``peer_region``'s peer listener (``client_tls``: this balancer's mTLS
    context; None without tls), and the headers of its answer."""
    headers = {"Content-Type": "application/json", HOP_HEADER: "1", TOKEN_HEADER: peer_token, ORIGIN_HEADER: region}
    if req.slo_class:  # the peer judges placement by the same class
        headers[SLO_CLASS_HEADER] = req.slo_class

    def peer_headers(upstream: Upstream) -> dict[str, str]:
        return {
            "Content-Type": upstream.headers.get("Content-Type", "application/json"),
            "X-Skymesh-Region": upstream.headers.get("X-Skymesh-Region", peer_region),
            "X-Skymesh-Replica": upstream.headers.get("X-Skymesh-Replica", ""),
            "X-Skymesh-Offloaded": "1",
            # the regions this request went through, origin first ("a>b" when offloaded)
            "X-Skymesh-Path": f"{region}>{upstream.headers.get('X-Skymesh-Path', peer_region)}",
            "X-Request-Id": req.request_id,
        }

    return AttemptTarget(
        peer_url + request.path, headers, session, peer_headers,
        # mTLS: present this balancer's certificate, accept only the region dialed
        ssl=True if client_tls is None else client_tls,
        server_hostname=server_hostname,
    )


class Waiter:
    """Where one request's handler waits for the core's words on it, in the order said.

    Words are kept, not overwritten: the core may say several before the handler runs
    again (a placement, then :class:`AbandonAttempt` and a :class:`Reject` when the peer it
    was placed on died in between). A placement with a later word behind it was taken back
    before its attempt began, and is never carried out (:meth:`superseded`)."""

    __slots__ = ("_words", "_said", "attempt_task", "first_byte_at", "trace")

    def __init__(self, trace: RequestTrace | None = None) -> None:
        self._words: deque[Action] = deque()
        self._said = asyncio.Event()
        self.attempt_task: asyncio.Task[AttemptOutcome] | None = None
        # when the first byte of a streamed answer reached the balancer (its TTFT)
        self.first_byte_at: float | None = None
        # the request's spans (skymesh/balancer/tracing.py); None: tracing off
        self.trace = trace

    def say(self, action: Action) -> None:
        self._words.append(action)
        self._said.set()

    async def next_word(self) -> Action:
        while not self._words:
            self._said.clear()
            await self._said.wait()
        return self._words.popleft()

    def superseded(self) -> bool:
        """The core said something after the word just taken (so that word is stale)."""
        return self.holds_words()

    def holds_words(self) -> bool:
        """A word is said and not yet taken (the request is not waiting on the core)."""
        return bool(self._words)


class RequestFlow:
    """The serve/retry loop of admitted requests, and the outcome accounting.

    ``target``: where an attempt for a placement goes; ``timeouts``, ``chunk_tokens``:
    read per attempt (a reload changes them); ``cache_source``: the metrics label of a
    replica's cache source.
    """

    def __init__(self, core: RegionCore, metrics: BalancerMetrics, wake: asyncio.Event, *, target: TargetFor,
                 timeouts: Callable[[], UpstreamTimeouts], chunk_tokens: Callable[[], int],
                 cache_source: Callable[[str], str],
                 replica_urls: Callable[[], Collection[str]] = tuple) -> None:
        self.core = core
        self.metrics = metrics
        self.wake = wake
        self.waiters: dict[str, Waiter] = {}
        self._target = target
        self._timeouts = timeouts
        self._chunk_tokens = chunk_tokens
        self._cache_source = cache_source
        # the region's replicas' URLs: a prefill's KV endpoint must be one of theirs
        self._replica_urls = replica_urls

    def apply(self, actions: list[Action]) -> None:
        """Carry out the core's actions: wake the handler that waits for each request."""
        for action in actions:
            if isinstance(action, SendToReplica):
                self.metrics.observe_decision(self.core.view.request_of(action.request_id), action.decision)
            elif isinstance(action, ForwardToRegion):
                self.metrics.offloaded.labels("out", action.region).inc()
            waiter = self.waiters.get(action.request_id)
            if waiter is None:
                continue  # not this daemon's handler (cannot happen) or already gone
            if waiter.trace is not None and isinstance(action, SendToReplica | ForwardToRegion):
                policy = self.core.view.policy
                waiter.trace.placed(action, policy=policy.name, candidates=getattr(policy, "candidates", None),
                                    req=self.core.view.request_of(action.request_id))
            if isinstance(action, AbandonAttempt) and waiter.attempt_task is not None:
                # queued again already; stop the attempt that has sent the client nothing
                waiter.attempt_task.cancel()
                continue
            # an AbandonAttempt with no attempt running takes back a placement the handler
            # has not begun yet: said in order, so the handler skips that placement
            waiter.say(action)

    def reject(self, r: Reject) -> web.Response:
        self.metrics.rejections.labels(str(r.status)).inc()
        headers = {"Retry-After": retry_after_header(r.retry_after_s)} if r.retry_after_s else {}
        if r.code == HARMFUL_REQUEST_CODE:
            # a verdict on the request, not on this region: an origin that forwarded it
            # passes it on instead of trying another region (proxy.py)
            self.metrics.harmful_requests.inc()
            headers[FINAL_ANSWER_HEADER] = "1"
            log.warning("request judged to have made its replica fail", extra={"request_id": r.request_id,
                                                                              "reason": r.message})
        return error_response(r.status, r.message, code=r.code, headers=headers or None)

    async def serve(
        self, request: web.Request, raw: bytes, req: RoutingRequest, stream: bool, waiter: Waiter,
        single_prompt: bool = True, slo: SloClass | None = None,
    ) -> web.StreamResponse:
        trace = waiter.trace
        # a split request's decode leg as last sent (the prefill's KV parameters in it): a
        # decode leg placed again after a failure before its first token resends it
        decode_leg: bytes | None = None
        while True:
            # a word already said (a placement made while an abandoned attempt ended) is no wait
            if trace is not None and not waiter.holds_words():
                trace.queued()
            action = await waiter.next_word()
            if isinstance(action, Reject):
                if trace is not None:
                    trace.rejected(action)
                self.count_slo_outcome(req, slo, "rejected")
                return self.reject(action)
            if isinstance(action, AbandonAttempt):
                continue  # it took back the placement skipped below
            assert isinstance(action, SendToReplica | ForwardToRegion)
            if waiter.superseded():
                # taken back before its attempt began (its peer died in between): the core
                # queued it again or answered it, and says so next
                self.metrics.retries.labels("peer" if isinstance(action, ForwardToRegion) else "replica").inc()
                continue
            target = self._target(request, req, action)
            if target is None:  # the replica left membership between placement and now
                self.apply(self.core.fail(req.request_id, loop_clock(), reason="left membership",
                                          counts_against_health=False))
                continue
            on_peer = isinstance(action, ForwardToRegion)
            timeouts = self._timeouts()
            body = raw
            is_decode_leg = False
            if isinstance(action, SendToReplica) and action.decision.decode_replica_id is not None:
                # a split request: its prefill leg first, then the decode leg is the attempt
                legs = await self._prefill(request, raw, req, waiter, action, target, timeouts)
                if legs is None:
                    continue  # the core was told, or took it back: its next word follows
                target, body = legs
                decode_leg, is_decode_leg = body, True
            elif isinstance(action, SendToReplica) and action.decision.decode_leg and decode_leg is not None:
                body, is_decode_leg = decode_leg, True
            if is_decode_leg:  # a split request's decode leg: bounded by its KV move
                deadline = timeouts.decode_leg_deadline_s(
                    transfer_s=self.core.view.transfer_estimate_s(req.request_id), stream=stream,
                    max_tokens=req.max_tokens)
            else:
                deadline = timeouts.first_byte_deadline_s(
                    stream=stream,
                    max_tokens=req.max_tokens,
                    # a peer may queue it for up to its own queue-wait bound first
                    extra_s=(self.core.settings.max_queue_wait_s or 0.0) if on_peer else 0.0,
                )
            span = None if trace is None else trace.attempt_started(action, target)
            task = waiter.attempt_task = asyncio.create_task(
                attempt(request, body, target, timeouts, deadline, self._first_byte_hook(req, waiter, span))
            )
            try:
                outcome = await task
            except asyncio.CancelledError:
                if span is not None:
                    span.ended(None)
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the client went away (the balancer's handler releases it)
                # AbandonAttempt: the core queued it again already (or a Reject follows);
                # wait for the next word
                self.metrics.retries.labels("peer" if on_peer else "replica").inc()
                continue
            finally:
                waiter.attempt_task = None
            if span is not None:
                span.ended(outcome)
            now = loop_clock()
            if outcome.outcome is Outcome.SERVED:
                if isinstance(action, SendToReplica) and single_prompt:
                    self._judge_prediction(action, outcome.tail)
                self.core.complete(req.request_id, now)
                self.wake.set()
                self._judge_served(req, slo, waiter, outcome, now, served_by_peer=on_peer)
                assert outcome.response is not None
                return outcome.response
            if outcome.outcome is Outcome.FAILED_MIDSTREAM:
                self.metrics.midstream_failures.labels("peer" if on_peer else "replica").inc()
                self.core.fail(req.request_id, now, reason=outcome.reason)
                self.wake.set()
                self.count_slo_outcome(req, slo, "failed")
                assert outcome.response is not None
                return outcome.response
            log.warning("attempt failed before output",
                        extra={"target": getattr(action, "replica_id", None) or getattr(action, "region", None),
                               "reason": outcome.reason})
            actions = self.core.fail(req.request_id, now, reason=outcome.reason,
                                     counts_against_health=outcome.counts_against_health,
                                     harm=None if on_peer else outcome.harm)
            if not any(isinstance(a, Reject) and a.request_id == req.request_id for a in actions):
                self.metrics.retries.labels("peer" if on_peer else "replica").inc()
            self.apply(actions)
            self.wake.set()

    async def _prefill(self, request: web.Request, raw: bytes, req: RoutingRequest, waiter: Waiter,
                       action: SendToReplica, target: AttemptTarget,
                       timeouts: UpstreamTimeouts) -> tuple[AttemptTarget, bytes] | None:
        """A split request's prefill leg on ``action``'s replica (skymesh/balancer/pd_legs.py).
        Returns the decode leg's target and body, or None when the leg failed (the core
        was told, as of any attempt that sent the client nothing) or was taken back."""
        deadline = timeouts.prefill_leg_deadline_s(
            predicted_ttft_s=action.decision.estimated_ttft_s,
            ttft_target_s=req.slo_ttft_s if req.slo_ttft_s is not None else self.core.settings.ttft_slo_s)
        task = waiter.attempt_task = asyncio.create_task(prefill_leg(target, raw, timeouts, deadline))
        try:
            result = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the client went away (closing the leg aborts it at the replica)
            self.metrics.retries.labels("replica").inc()
            return None
        finally:
            waiter.attempt_task = None
        now = loop_clock()
        if not result.ok:
            log.warning("prefill leg failed", extra={"target": action.replica_id, "reason": result.reason})
            actions = self.core.fail(req.request_id, now, reason=result.reason,
                                     counts_against_health=result.counts_against_health)
            if not any(isinstance(a, Reject) and a.request_id == req.request_id for a in actions):
                self.metrics.retries.labels("replica").inc()
            self.apply(actions)
            self.wake.set()
            return None
        # parameters naming no replica of this region are dropped: the decode replica then
        # runs the prefill itself, as vLLM's does without them
        params = checked_params(result.params, replica_hosts(self._replica_urls()))
        decode = self.core.prefill_done(req.request_id, now)
        self.wake.set()
        if decode is None:
            return None
        decode_target = self._target(request, req, SendToReplica(req.request_id, decode, action.decision))
        if decode_target is None:  # the decode replica left membership
            self.apply(self.core.fail(req.request_id, now, reason="left membership", counts_against_health=False))
            return None
        return decode_target, decode_body(raw, params)

    def _judge_prediction(self, action: SendToReplica, tail: bytes) -> None:
        """Count how the policy's expected cached prefix compares with the replica's own
        count, when the replica reports one (vLLM's --enable-prompt-tokens-details)."""
        cached = reported_cached_tokens(tail)
        if cached is None:
            return
        result = judge_prediction(action.decision.matched_tokens, cached, self._chunk_tokens())
        self.metrics.cache_predictions.labels(result.value, self._cache_source(action.replica_id)).inc()

    def count_slo_outcome(self, req: RoutingRequest, slo: SloClass | None, outcome: str) -> None:
        if slo is not None and not req.forwarded:
            self.metrics.slo_outcomes.labels(slo.name, outcome).inc()

    def _judge_served(self, req: RoutingRequest, slo: SloClass | None, waiter: Waiter,
                      outcome: AttemptOutcome, now: float, *, served_by_peer: bool) -> None:
        """A served answer as its client saw it, counted once, where the client called: its
        latencies, and against its class's targets (see skymesh/slo_judge.py)."""
        if req.forwarded:
            return
        e2e = now - req.arrival
        ttft = None if waiter.first_byte_at is None else waiter.first_byte_at - req.arrival
        completion_tokens = reported_completion_tokens(outcome.tail)
        self.metrics.observe_client_latency(slo_class=slo.name if slo is not None else None,
                                            served_by_peer=served_by_peer, e2e_s=e2e, ttft_s=ttft,
                                            completion_tokens=completion_tokens)
        if slo is None:
            return
        missed = missed_targets(slo.targets, e2e_s=e2e, ttft_s=ttft, completion_tokens=completion_tokens)
        for target in missed:
            self.metrics.slo_target_misses.labels(slo.name, target).inc()
        self.count_slo_outcome(req, slo, "missed" if missed else "met")

    def _first_byte_hook(self, req: RoutingRequest, waiter: Waiter,
                         span: AttemptSpan | None = None) -> Callable[[bool], None]:
        def on_first_byte(is_stream: bool) -> None:
            if span is not None:
                span.first_byte()
            if is_stream:
                waiter.first_byte_at = loop_clock()
            # a non-streaming answer arrives whole: its first byte is not its first token,
            # so it must not feed the policy's TTFT model
            ttft = self.core.first_token(req.request_id, loop_clock(), observe=is_stream)
            if ttft is not None and is_stream:
                self.metrics.observed_ttft.observe(ttft)
            self.wake.set()

        return on_first_byte
