"""Intake of one request at the balancer's HTTP surface: parse the body, find the
region whose residency rules bind it, its SLO class, count and encode the prompt within
bounds (one that cannot fit the model is refused here: skymesh/balancer/prompt_count.py),
charge the key's token budget, submit it to the region core; what follows (the serve/retry loop) is
:class:`~skymesh.balancer.request_flow.RequestFlow`'s. Each check lives in one place: the
gate (credentials, body bounds, request rate) ran before this; the core's admission rules
(residency, SLO reachability, queue wait, queue bound) run in ``core.submit``."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from aiohttp import web

from skymesh.balancer.gate import CLIENT, ClientGate
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.openai_request import parse_body
from skymesh.balancer.prompt_count import PromptCounter
from skymesh.balancer.request_flow import HOP_HEADER, ORIGIN_HEADER, RequestFlow, Waiter
from skymesh.balancer.slo_class_lookup import SLO_CLASS_HEADER, resolve_slo_class
from skymesh.config import MeshConfig, region_of_address
from skymesh.context_window import ContextRefusal
from skymesh.edge.openai_errors import RequestError
from skymesh.routing.base import RoutingRequest
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import Reject
from skymesh.slo_judge import apply_slo_class

if TYPE_CHECKING:  # imported only when tracing is on (server.py)
    from skymesh.balancer.tracing import BalancerTracing, RequestTrace

log = logging.getLogger("skymesh.balancer")

# client addresses whose region is remembered (a client keeps its address across its
# requests; the table is dropped whole when full, and on a reload)
REMOTE_REGIONS_KEPT = 4096


class RequestIntake:
    """Turns an HTTP request into a routing request the core has accepted (or the answer
    that refuses it), then hands it to the request flow."""

    def __init__(self, cfg: MeshConfig, region: str, *, core: RegionCore, flow: RequestFlow, gate: ClientGate,
                 metrics: BalancerMetrics, wake: asyncio.Event, counter: PromptCounter,
                 peers: Callable[[], Collection[str]], on_request_end: Callable[[], None],
                 tracing: BalancerTracing | None = None, stopping: Callable[[], bool] = lambda: False) -> None:
        self.region = region
        self.core = core
        self.flow = flow
        self.gate = gate
        self.metrics = metrics
        self.wake = wake
        self.counter = counter
        self._peers = peers
        self._on_request_end = on_request_end
        self._stopping = stopping  # the balancer is stopping (its handlers are cancelled)
        # OpenTelemetry spans (skymesh/balancer/tracing.py); None: off, no span is made
        self.tracing = tracing
        self._ids = itertools.count()
        self.reconfigure(cfg)

    def reconfigure(self, cfg: MeshConfig) -> None:
        """A reloaded config: requests admitted from now on read it."""
        self.cfg = cfg
        self._source_networks = cfg.source_network_table()
        self._remote_regions: dict[str, str | None] = {}

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        if self.tracing is None:
            return await self._handle(request, kind, None)
        trace = self.tracing.request(request)
        try:
            response = await self._handle(request, kind, trace)
        except BaseException as e:
            trace.ended(None, e)
            raise
        trace.ended(response.status)
        return response

    async def _handle(self, request: web.Request, kind: str, trace: RequestTrace | None) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        try:
            # the gate read the body within its bounds (its 413, 415, 408 answered there)
            # and let a forward in only on the peer listener with the peer token
            raw = await request.read()
            forwarded = HOP_HEADER in request.headers
            parsed = parse_body(raw, kind, self.cfg.model)
            origin = self.origin_of(request, forwarded)
            client = request.get(CLIENT)
            slo = resolve_slo_class(self.cfg, request.headers.get(SLO_CLASS_HEADER),
                                    client.slo_class if client is not None else None)
            encoded = await self.counter.count(parsed)
        except RequestError as e:
            self.metrics.rejections.labels(str(e.status)).inc()
            if isinstance(e, ContextRefusal):
                self.metrics.context_refusals.labels(e.proved_by).inc()
            return e.response()
        now = loop.time()
        req = RoutingRequest(
            request_id=f"{self.region}-{next(self._ids)}-{os.getpid()}",
            chunk_hashes=encoded.chunk_hashes,
            prompt_tokens=encoded.tokens,
            arrival=now,
            max_tokens=(self.cfg.upstream.unbounded_chat_max_tokens if parsed.max_tokens is None
                        else parsed.max_tokens),
            session_key=request.headers.get("X-Session-ID") or parsed.user,
            forwarded=forwarded,
            origin_region=origin,
        )
        apply_slo_class(req, slo)
        if trace is not None:
            trace.admitted(req, stream=parsed.stream, slo_class=req.slo_class or None)
        if (limited := self.gate.charge_prompt(request, req.prompt_tokens, now)) is not None:
            return limited
        if forwarded:
            # the origin was checked against the configured regions: a bounded label
            self.metrics.offloaded.labels("in", origin or "unknown").inc()
        if slo is not None and not forwarded:  # judged where the client called, once
            self.metrics.slo_requests.labels(slo.name).inc()
        waiter = self.flow.waiters[req.request_id] = Waiter(trace)
        try:
            for action in self.core.submit(req, now):
                assert isinstance(action, Reject)
                if trace is not None:
                    trace.rejected(action)
                self.flow.count_slo_outcome(req, slo, "rejected")
                return self.flow.reject(action)
            self.wake.set()
            return await self.flow.serve(request, raw, req, parsed.stream, waiter, parsed.batch_size == 1, slo)
        except asyncio.CancelledError:
            self.flow.count_slo_outcome(req, slo, "cancelled")  # the client went away
            self._cut(request, req, loop.time())
            raise
        finally:
            self.flow.waiters.pop(req.request_id, None)
            # no-op when the request ended; frees its queue slot or replica otherwise
            self.core.client_gone(req.request_id, loop.time())
            self.wake.set()
            self._on_request_end()

    def _cut(self, request: web.Request, req: RoutingRequest, now: float) -> None:
        """The request's handler was cancelled before its answer was complete: its client's
        connection closed (``handler_cancellation``), or the balancer is stopping. One log
        line and a count by reason and state (queued, placed, streaming), so a client that
        saw its connection close can be matched with what the balancer saw."""
        state = self.core.view.state_of(req.request_id)
        where = state.value if state is not None else "unknown"
        reason = "stopping" if self._stopping() else f"client_gone_{where}"
        self.metrics.requests_cut.labels(reason).inc()
        log.info("request ended without an answer", extra={
            "request_id": req.request_id, "reason": reason, "waited_s": round(now - req.arrival, 3),
            "client": request.remote or "", "origin": req.origin_region or self.region,
            "forwarded": req.forwarded, "queue_length": self.core.view.queue_length})

    def origin_of(self, request: web.Request, forwarded: bool) -> str | None:
        """The region whose residency rules bind this request: for a forwarded one, the
        origin its peer names (with tls, bound to the peer's certificate by the peer
        listener; and token-checked); else the region of the client's source
        network. None: this balancer's own region (an address in no source network)."""
        if forwarded:
            origin = request.headers.get(ORIGIN_HEADER, "")
            if origin not in self._peers():
                raise RequestError(400, "forwarded request without a known origin region")
            return origin
        region = self._region_of_remote(request.remote or "")
        return None if region == self.region else region

    def _region_of_remote(self, remote: str) -> str | None:
        """``region_of_address`` of a client address, parsed once per address (not per request)."""
        try:
            return self._remote_regions[remote]
        except KeyError:
            pass
        if len(self._remote_regions) >= REMOTE_REGIONS_KEPT:
            self._remote_regions.clear()
        region = self._remote_regions[remote] = region_of_address(self._source_networks, remote)
        return region
