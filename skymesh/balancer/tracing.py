"""OpenTelemetry spans of one balancer (``tracing:`` in the mesh config; docs/observability.md).

Imported only when tracing is on (server.py): with it off no OpenTelemetry module is
loaded and a request makes no span object; the request path only tests ``trace is None``.

One trace per request across balancers and regions. At the balancer that admits a request:

- ``skymesh.request`` (SERVER): from intake to the answer; its parent is the caller's W3C
  ``traceparent`` when one came (a client, or the forwarding balancer's attempt span at a
  peer listener, where only mesh peers are let in). Trace context is only ever read into
  spans: routing never sees it.
- ``skymesh.queue_wait`` (INTERNAL): each wait in the region core's queue, ended by the
  core's word (placed, forwarded, rejected); a retry waits again.
- a ``skymesh.placement`` event on the request span: the policy, its reason, the
  candidates (when the policy names them, e.g. DualMap's two), the predicted cached
  tokens and the chosen replica, or the peer region.
- ``skymesh.attempt`` (CLIENT) per attempt on a replica, ``skymesh.forward`` (CLIENT) per
  forward to a peer region: the retry count, the target, the outcome. The attempt's own
  ``traceparent`` goes in its headers, so the replica (vLLM with --otlp-traces-endpoint)
  or the peer balancer parents its span on it.

Spans are batched and exported over OTLP/HTTP (protobuf) by the SDK's worker thread;
``span.end()`` only queues, so the event loop never waits on the collector. Each balancer
has its own provider (its resource names its region and balancer id); nothing global is set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from aiohttp import web
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import (
    INVALID_SPAN,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from skymesh.balancer.proxy import AttemptOutcome, AttemptTarget, Outcome
from skymesh.config import TracingConfig
from skymesh.routing.base import RoutingRequest
from skymesh.routing.region_actions import ForwardToRegion, Reject, SendToReplica

# W3C trace context only: no baggage (a caller's baggage would ride into our spans)
PROPAGATOR = TraceContextTextMapPropagator()
INSTRUMENTATION = "skymesh.balancer"

REQUEST_SPAN = "skymesh.request"
QUEUE_WAIT_SPAN = "skymesh.queue_wait"
ATTEMPT_SPAN = "skymesh.attempt"
FORWARD_SPAN = "skymesh.forward"
PLACEMENT_EVENT = "skymesh.placement"
FIRST_BYTE_EVENT = "skymesh.first_byte"

# the policy's candidates for a request, when it has fixed ones (DualMap); None: it has not
Candidates = Callable[[RoutingRequest], tuple[str, ...]] | None


class RequestTrace:
    """The spans of one request at this balancer. Made only when tracing is on."""

    __slots__ = ("_tracer", "_span", "_queue_wait", "_attempts")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span
        self._queue_wait: Span | None = None
        self._attempts = 0

    @property
    def span(self) -> Span:
        return self._span

    def admitted(self, req: RoutingRequest, *, stream: bool, slo_class: str | None) -> None:
        """What the request is, once parsed (request_intake.py)."""
        attrs: dict[str, str | int | bool] = {
            "skymesh.request_id": req.request_id,
            "skymesh.prompt_tokens": req.prompt_tokens,
            "skymesh.max_tokens": req.max_tokens,
            "skymesh.stream": stream,
            "skymesh.forwarded": req.forwarded,
        }
        if req.origin_region is not None:
            attrs["skymesh.origin_region"] = req.origin_region
        if slo_class is not None:
            attrs["skymesh.slo_class"] = slo_class
        self._span.set_attributes(attrs)

    def queued(self) -> None:
        """The request waits for the core's word (again, after a failed attempt)."""
        if self._queue_wait is None:
            self._queue_wait = self._child(QUEUE_WAIT_SPAN, SpanKind.INTERNAL)

    def placed(self, action: SendToReplica | ForwardToRegion, *, policy: str, candidates: Candidates,
               req: RoutingRequest | None) -> None:
        """The core's placement, when it is made (RequestFlow.apply)."""
        attrs: dict[str, str | int | float | tuple[str, ...]] = {"skymesh.policy": policy}
        if isinstance(action, SendToReplica):
            d = action.decision
            attrs["skymesh.placement.replica"] = action.replica_id
            attrs["skymesh.placement.reason"] = d.reason
            attrs["skymesh.placement.predicted_cached_tokens"] = d.matched_tokens
            if d.estimated_ttft_s is not None:
                attrs["skymesh.placement.estimated_ttft_s"] = d.estimated_ttft_s
            if candidates is not None and req is not None:
                attrs["skymesh.placement.candidates"] = tuple(candidates(req))
            outcome = "placed"
        else:
            attrs["skymesh.placement.region"] = action.region
            outcome = "forwarded"
        self._span.add_event(PLACEMENT_EVENT, attrs)
        self._end_queue_wait(outcome)

    def rejected(self, r: Reject) -> None:
        self._span.set_attributes({"skymesh.rejected.code": r.code})
        self._end_queue_wait("rejected")

    def attempt_started(self, action: SendToReplica | ForwardToRegion, target: AttemptTarget) -> AttemptSpan:
        """A client span for one attempt; its traceparent goes into ``target``'s headers."""
        self._attempts += 1
        attrs: dict[str, str | int] = {
            "skymesh.attempt": self._attempts,
            "skymesh.retries": self._attempts - 1,
            "url.full": target.url,
            "http.request.method": "POST",
        }
        if isinstance(action, ForwardToRegion):
            attrs["skymesh.peer_region"] = action.region
            span = self._child(FORWARD_SPAN, SpanKind.CLIENT, attrs)
        else:
            attrs["skymesh.replica"] = action.replica_id
            span = self._child(ATTEMPT_SPAN, SpanKind.CLIENT, attrs)
        headers = dict(target.headers)  # a copy: the target's dict may be shared
        PROPAGATOR.inject(headers, context=set_span_in_context(span))
        target.headers = headers
        return AttemptSpan(span)

    def ended(self, status: int | None, error: BaseException | None = None) -> None:
        """The request's answer (``status``), or what ended it without one."""
        self._end_queue_wait("cancelled" if error is not None else "ended")
        if status is not None:
            self._span.set_attribute("http.response.status_code", status)
            if status >= 500:
                self._span.set_status(Status(StatusCode.ERROR))
        if isinstance(error, asyncio.CancelledError):
            self._span.set_attribute("skymesh.outcome", "client_gone")
        elif error is not None:
            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self._span.end()

    def _child(self, name: str, kind: SpanKind, attrs: Mapping[str, str | int] | None = None) -> Span:
        return self._tracer.start_span(name, context=set_span_in_context(self._span), kind=kind, attributes=attrs)

    def _end_queue_wait(self, outcome: str) -> None:
        if self._queue_wait is not None:
            self._queue_wait.set_attribute("skymesh.queue.outcome", outcome)
            self._queue_wait.end()
            self._queue_wait = None


class UnsampledRequestTrace(RequestTrace):
    """A request whose trace is not sampled: no child span is made (none would be
    recorded), but each attempt still carries the request's ``traceparent`` (its sampled
    flag clear), so the replica and a peer balancer leave it unsampled too."""

    __slots__ = ()

    def admitted(self, req: RoutingRequest, *, stream: bool, slo_class: str | None) -> None:
        pass

    def queued(self) -> None:
        pass

    def placed(self, action: SendToReplica | ForwardToRegion, *, policy: str, candidates: Candidates,
               req: RoutingRequest | None) -> None:
        pass

    def rejected(self, r: Reject) -> None:
        pass

    def attempt_started(self, action: SendToReplica | ForwardToRegion, target: AttemptTarget) -> AttemptSpan:
        headers = dict(target.headers)
        PROPAGATOR.inject(headers, context=set_span_in_context(self._span))
        target.headers = headers
        return UNSAMPLED_ATTEMPT

    def ended(self, status: int | None, error: BaseException | None = None) -> None:
        pass


class AttemptSpan:
    """The client span of one attempt (a replica) or forward (a peer region)."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def first_byte(self) -> None:
        self.span.add_event(FIRST_BYTE_EVENT)

    def ended(self, outcome: AttemptOutcome | None) -> None:
        """``outcome`` None: the attempt was stopped (its placement taken back, or the
        client left)."""
        span = self.span
        if outcome is None:
            span.set_attribute("skymesh.outcome", "abandoned")
        else:
            span.set_attribute("skymesh.outcome", outcome.outcome.value)
            if outcome.reason:
                span.set_attribute("skymesh.reason", outcome.reason)
            if outcome.response is not None:
                span.set_attribute("http.response.status_code", outcome.response.status)
            if outcome.outcome is not Outcome.SERVED:
                span.set_status(Status(StatusCode.ERROR, outcome.reason or outcome.outcome.value))
        span.end()


# what an unsampled request's attempts record: nothing (every call on it is a no-op)
UNSAMPLED_ATTEMPT = AttemptSpan(INVALID_SPAN)


class BalancerTracing:
    """One balancer's tracer provider: its resource, sampler and batching exporter."""

    def __init__(self, cfg: TracingConfig, *, region: str, balancer_id: str,
                 exporter: SpanExporter | None = None) -> None:
        """``exporter``: where spans go instead of ``cfg.endpoint`` (tests)."""
        resource = Resource.create({
            **cfg.resource_attributes,
            "service.name": cfg.service_name,
            "service.instance.id": balancer_id,
            "cloud.region": region,
            "skymesh.region": region,
            "skymesh.balancer.id": balancer_id,
        })
        self._provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(cfg.sampling_ratio)))
        if exporter is None:
            assert cfg.traces_url is not None, "tracing is off (tracing.endpoint unset)"
            exporter = OTLPSpanExporter(endpoint=cfg.traces_url, timeout=cfg.batch.export_timeout_s)
        b = cfg.batch
        self._provider.add_span_processor(BatchSpanProcessor(
            exporter, max_queue_size=b.max_queue_size, schedule_delay_millis=b.schedule_delay_ms,
            max_export_batch_size=b.max_export_batch_size, export_timeout_millis=int(b.export_timeout_s * 1000)))
        self._tracer = self._provider.get_tracer(INSTRUMENTATION)
        self._stopped = False

    def request(self, request: web.Request) -> RequestTrace:
        """The server span of a request that passed the gate: a client's or a mesh peer's
        ``traceparent`` (the peer listener lets only peers in) makes it a child span."""
        parent = PROPAGATOR.extract(request.headers)
        span = self._tracer.start_span(REQUEST_SPAN, context=parent, kind=SpanKind.SERVER, attributes={
            "http.request.method": request.method,
            "url.path": request.path,
        })
        if not span.is_recording():  # not sampled (the ratio, or a caller's unsampled traceparent)
            return UnsampledRequestTrace(self._tracer, span)
        return RequestTrace(self._tracer, span)

    async def shutdown(self) -> None:
        """Export what is left (force_flush) and stop the worker, off the event loop; once."""
        if not self._stopped:
            self._stopped = True
            await asyncio.to_thread(self._flush_and_stop)

    def _flush_and_stop(self) -> None:
        self._provider.force_flush()
        self._provider.shutdown()
