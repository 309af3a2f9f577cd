"""Every skymesh HTTP server (balancer, controller, DNS control API, stand-in replica)
is aiohttp's, run by :class:`EdgeAppRunner`, which adds what aiohttp's server lacks for a
public edge:

* **Nothing decoded before the caller is known.** ``auto_decompress`` is off: aiohttp's
  parser would inflate a gzip body inside ``data_received``, before any route or
  credential check; bodies are read and inflated by ``edge/body.py``, with bounds, after
  the app's checks.
* **A bounded request head**: besides aiohttp's per-line, per-field and header-count
  limits, the bytes of one incomplete request head are capped (``max_head_bytes``); over
  it, a 431 and the connection closes (a 1 MB head no longer sits in memory).
* **A cap on open connections**, in all and per source address: a connection over it is
  answered 503 with ``Connection: close`` before anything is read, and counted in
  ``skymesh_http_connections_refused_total``; ``skymesh_http_connections_open`` is the
  gauge. With the head bound, memory under a flood is bounded by configuration.
* **Timeouts**: aiohttp's keep-alive timer is the header timeout (it is armed when a
  connection opens and after each response and closes a connection still waiting for a
  complete head); bodies have their own timeout where they are read (edge/body.py).
* **Errors in JSON**, also what aiohttp answers before the app's error middleware can
  see a request:

  - A request aiohttp's HTTP parser rejects (a malformed request line or header, a head
    over its size limits, broken chunked framing) is answered from
    ``RequestHandler.handle_error``, text/plain in aiohttp. :class:`EdgeRequestHandler`
    answers it in JSON with ``Connection: close``, a 400 (431 for a head too large),
    counted in ``skymesh_rejections_total``.
  - A parse error in the body of a request the app already has (bytes that arrived after
    its head) is set on that request's body, as aiohttp does for a body that does not
    decompress, instead of queueing a second error response behind that request: a
    handler reading the body answers a JSON 400 (middleware), one that does not has
    answered already; either way the connection then closes.
  - aiohttp's drain of an answered request's unread body logs "Unhandled exception" when
    the body fails to read. That is the client's broken body: logged at debug here.
  - An ``HTTPException`` raised outside the middleware (a bad ``Expect`` header, answered
    before the middleware runs) becomes JSON too.

The aiohttp internals used are commented where used; tests/test_http_parser_errors.py
and tests/test_edge.py pin them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest

from skymesh.config import MeshConfig
from skymesh.edge.connection_metrics import EdgeMetrics
from skymesh.edge.connections import ConnectionLimiter
from skymesh.edge.openai_errors import (
    describe_http_error,
    error_body,
    error_response,
    http_exception_response,
)

log = logging.getLogger("skymesh.edge")

RequestHandlerFn = Callable[[BaseRequest], Awaitable[web.StreamResponse]]

# aiohttp's message when it lacks the library for a coding it knows: "Can not decode
# content-encoding: brotli (br). Please install `Brotli`" (likewise zstd)
_MISSING_DECODER = re.compile(r"\((?P<coding>[\w.-]+)\)\. Please install")
_HEAD_TOO_LARGE = ("Too many headers", "Too many trailers")


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """What one server allows a connection (config: ``http_limits`` and
    ``client_timeouts``)."""

    max_connections: int = 4096
    max_connections_per_source: int = 1024
    # bytes of one request head still incomplete (request line and all header fields)
    max_head_bytes: int = 64 * 1024
    # from connect (or the end of the previous response) to a complete request head
    header_timeout_s: float = 10.0
    # how long an answered request's unread body is drained before the connection closes
    lingering_s: float = 2.0

    @classmethod
    def from_config(cls, cfg: MeshConfig) -> EdgeLimits:
        return cls(max_connections=cfg.http_limits.max_connections,
                   max_connections_per_source=cfg.http_limits.max_connections_per_source,
                   max_head_bytes=cfg.http_limits.max_head_bytes,
                   header_timeout_s=cfg.client_timeouts.header_timeout_s)

    def handler_options(self) -> dict[str, Any]:
        """aiohttp RequestHandler options these limits set."""
        return {"keepalive_timeout": self.header_timeout_s, "lingering_time": self.lingering_s,
                "auto_decompress": False}


class HeadTooLarge(BadHttpMessage):
    """An incomplete request head over ``max_head_bytes``."""


def parser_error_response(exc: BaseException | None, status: int, limits: RequestHandler | None = None) -> web.Response:
    """The JSON answer to a request aiohttp's parser rejected with ``exc``; ``status`` is
    what aiohttp would answer (400 for every parse error; 500/504 for a handler that
    raised, which the middleware answers first). ``limits``: the connection's handler,
    whose size limits a 431 names."""
    detail = describe_http_error(exc) if exc is not None else ""
    if isinstance(exc, HeadTooLarge | LineTooLong) or (
            isinstance(exc, BadHttpMessage) and exc.message.startswith(_HEAD_TOO_LARGE)):
        # the parser does not say whether the request line or a header was too long
        bound = (f" (limits: request line {limits.max_line_size} bytes, header field {limits.max_field_size}"
                 f" bytes, {limits.max_headers} header fields"
                 f"{_head_bound(limits)})" if limits is not None else "")
        status, code, message = 431, "request_header_fields_too_large", f"request head too large{bound}: {detail}"
    elif isinstance(exc, ContentEncodingError) and (missing := _MISSING_DECODER.search(exc.message)):
        status, code = 415, "unsupported_content_encoding"
        message = f"Content-Encoding {missing['coding']!r} is not supported (gzip and deflate are)"
    elif isinstance(exc, ContentEncodingError):
        status, code, message = 400, "invalid_content_encoding", f"request body does not decode: {detail}"
    elif isinstance(exc, BadStatusLine | InvalidURLError):
        status, code, message = 400, "invalid_request_line", f"malformed request line: {detail}"
    elif isinstance(exc, HttpProcessingError) or 400 <= status < 500:
        status = status if 400 <= status < 500 else 400
        code, message = "invalid_request", f"malformed request: {detail}" if detail else "malformed request"
    else:
        code, message = "internal_error", "internal error"
    headers = {"Connection": "close"}  # HTTP/1.0 (aiohttp's version for these) says so only if told
    if status == 415:
        headers["Accept-Encoding"] = "gzip, deflate"
    response = error_response(status, message, code=code, headers=headers)
    response.force_close()
    return response


def _head_bound(handler: RequestHandler) -> str:
    limits = getattr(handler, "edge_limits", None)
    return f", {limits.max_head_bytes} bytes in all" if isinstance(limits, EdgeLimits) else ""


def _overflow_answer(reason: str) -> bytes:
    """The raw 503 a connection over the cap gets, before anything is read from it."""
    body = json.dumps(error_body(
        503, f"too many open connections ({reason.replace('_', ' ')}); retry shortly",
        code="too_many_connections")).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


class _BoundedParser:
    """Stands in for a connection's HTTP parser:

    * bytes of a request head still incomplete are counted, and over ``max_head_bytes``
      the head is refused (:class:`HeadTooLarge`, a 431) before they are buffered;
    * a parse error while the body of a request already parsed is arriving (bad chunked
      framing) is set on that request's body, instead of reaching ``data_received``,
      which would queue an error response behind that request (two responses, or a
      handler reading the body waiting out the body timeout)."""

    __slots__ = ("_parser", "_body", "_failed", "_head_bytes", "_max_head_bytes")

    def __init__(self, parser: Any, max_head_bytes: int) -> None:
        self._parser = parser
        self._body: StreamReader | None = None  # the body of the last request parsed
        self._failed = False
        self._head_bytes = 0  # bytes fed since the last complete head, outside a body
        self._max_head_bytes = max_head_bytes

    def _in_head(self) -> bool:
        return self._body is None or self._body.is_eof()

    def feed_data(self, data: bytes) -> Any:
        if self._failed:
            return (), False, b""  # the parser stopped at the error; the connection closes
        if self._in_head():  # between requests: these bytes are a head, until it completes
            allowance = self._max_head_bytes - self._head_bytes
            if len(data) > allowance:
                # only the allowance is parsed as head; what follows a head completed
                # within it (a body, the next request) is fed on as usual
                messages, upgraded, tail = self._feed(data[:allowance])
                if self._failed:
                    return messages, upgraded, tail
                if not messages:
                    self._failed = True
                    raise HeadTooLarge(f"request head over {self._max_head_bytes} bytes")
                if upgraded:
                    return messages, upgraded, tail + data[allowance:]
                more, upgraded, tail = self.feed_data(data[allowance:])
                return [*messages, *more], upgraded, tail
            self._head_bytes += len(data)
        return self._feed(data)

    def _feed(self, data: bytes) -> Any:
        in_head = self._in_head()
        try:
            result = self._parser.feed_data(data)
        except HttpProcessingError as exc:
            self._failed = True
            if in_head:
                raise  # an error in a request's head: handle_error answers it
            failure = RequestPayloadError(describe_http_error(exc))
            failure.__cause__ = exc
            assert self._body is not None
            self._body.set_exception(failure)
            return (), False, b""
        if result[0]:
            self._body = result[0][-1][1]
            self._head_bytes = 0
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class EdgeRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol with the edge's bounds (module doc)."""

    __slots__ = ("_metrics", "_limiter", "_refusals", "_source", "edge_limits")

    def __init__(self, manager: EdgeServer, *, loop: asyncio.AbstractEventLoop, **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._metrics = manager.metrics
        self._limiter = manager.limiter
        self._refusals = manager.refusals
        self.edge_limits = manager.limits
        self._source: str | None = None  # set while this connection holds a slot
        # private: aiohttp has no hook between its parser and the queue of parsed requests
        self._parser = _BoundedParser(self._parser, manager.limits.max_head_bytes)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple | list) and peer else "unknown"
        refused = self._limiter.open(source)
        if refused is not None:
            self._metrics.connections_refused.labels(refused).inc()
            self._refusals.note(refused, source)
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(_overflow_answer(refused))
            transport.close()  # flushes the 503 first; connection_lost follows
            self._force_close = True  # private (aiohttp's): nothing is read or started
            return
        self._source = source
        self._metrics.connections_open.inc()
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._source is None:
            return  # refused at connection_made: aiohttp never saw this connection
        self._limiter.close(self._source)
        self._source = None
        self._metrics.connections_open.dec()
        super().connection_lost(exc)

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for another response
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        response = parser_error_response(exc, status, self)
        if response.status >= 500:
            self._metrics.internal_errors.inc()  # the middleware answers handler errors: a bug
            log.error("error answered outside the app", exc_info=exc)
        else:
            self._metrics.rejections.labels(str(response.status)).inc()
            log.debug("rejected a request aiohttp could not parse (%d)", response.status, exc_info=exc)
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        if isinstance(kw.get("exc_info"), RequestPayloadError):
            # aiohttp draining an answered request's unread body hit the body's own error;
            # the connection closes: the client's broken body, not a bug
            log.debug("unread request body failed: %s", kw["exc_info"])
            return
        super().log_exception(*args, **kw)


def json_http_exceptions(handler: RequestHandlerFn, metrics: EdgeMetrics) -> RequestHandlerFn:
    """``handler`` (the app's) answering an ``HTTPException`` raised outside the
    middleware (aiohttp's ``Expect`` check runs before it) in JSON."""

    async def answer(request: BaseRequest) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            metrics.rejections.labels(str(e.status)).inc()
            return http_exception_response(e)

    return answer


class RefusalLog:
    """One log line for connections refused at a cap, at most every ``every_s``: the
    first refusal is logged at once, later ones are summed into the next line (a flood
    must not become a flood of lines). A client that saw its connection closed (a 503
    written before its request was read can reach it as a reset) is found here."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._last = float("-inf")
        self._since: dict[str, int] = {}

    def note(self, reason: str, source: str) -> None:
        self._since[reason] = self._since.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        log.warning("connections refused at the connection cap (answered 503, closed before reading)",
                    extra={"refused": dict(self._since), "last_source": source})
        self._since.clear()


class EdgeServer(web.Server):
    """``web.Server`` whose connections are :class:`EdgeRequestHandler`."""

    def __init__(self, handler: RequestHandlerFn, *, metrics: EdgeMetrics, limits: EdgeLimits,
                 request_factory: Any = None, handler_cancellation: bool = False,
                 loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
        loop = loop or asyncio.get_running_loop()
        super().__init__(json_http_exceptions(handler, metrics), request_factory=request_factory,
                         handler_cancellation=handler_cancellation, loop=loop, **kwargs)
        self.metrics = metrics
        self.limits = limits
        self.limiter = ConnectionLimiter(limits.max_connections, limits.max_connections_per_source)
        self.refusals = RefusalLog()
        self._handler_loop = loop
        self._handler_kwargs = kwargs  # RequestHandler's options, as web.Server passes them

    def __call__(self) -> RequestHandler:
        return EdgeRequestHandler(self, loop=self._handler_loop, **self._handler_kwargs)


def site_port(site: web.TCPSite) -> int:
    """The port ``site`` bound (the kernel's pick for port 0)."""
    server = getattr(site, "_server", None)  # private: aiohttp exposes no bound port per site
    assert server is not None and server.sockets, "the site is not started"
    return int(server.sockets[0].getsockname()[1])


class EdgeAppRunner(web.AppRunner):
    """``web.AppRunner`` serving its app with :class:`EdgeServer` under ``limits``."""

    __slots__ = ("_metrics", "_limits")

    def __init__(self, app: web.Application, *, metrics: EdgeMetrics, limits: EdgeLimits, **kwargs: Any) -> None:
        kwargs = {"access_log": None, "handle_signals": False, **limits.handler_options(), **kwargs}
        super().__init__(app, **kwargs)
        self._metrics = metrics
        self._limits = limits

    async def _make_server(self) -> web.Server:
        # private: the one place AppRunner builds its web.Server (after the app's startup)
        made = await super()._make_server()
        return EdgeServer(
            made.request_handler, metrics=self._metrics, limits=self._limits,
            request_factory=made.request_factory, handler_cancellation=made.handler_cancellation,
            **made._kwargs,  # private: the RequestHandler options the runner and app gave it
        )
