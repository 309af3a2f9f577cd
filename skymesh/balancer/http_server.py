"""The balancer's HTTP server: aiohttp's, with OpenAI-shaped JSON also for what aiohttp
answers before the app's error middleware (middleware.py) can see a request.

* A request aiohttp's HTTP parser rejects (a malformed request line or header, a head
  over its size limits, broken chunked framing, a ``Content-Encoding`` it has no decoder
  for) is answered from ``RequestHandler.handle_error``, text/plain in aiohttp.
  :class:`JsonErrorRequestHandler` answers it in JSON with ``Connection: close``, a 400
  (431 for a head too large, 415 for an unsupported coding), counted in
  ``skymesh_rejections_total``.
* A parse error in the body of a request the app already has (bytes that arrived after
  its head) is set on that request's body, as aiohttp does for a body that does not
  decompress, instead of queueing a second error response behind that request: a handler
  reading the body answers a JSON 400 (middleware), one that does not has answered
  already; either way the connection then closes.
* aiohttp's drain of an answered request's unread body logs "Unhandled exception" when
  the body fails to read. That is the client's broken body: logged at debug here.
* An ``HTTPException`` raised outside the middleware (a bad ``Expect`` header, answered
  before the middleware runs) becomes JSON too.

:class:`JsonErrorAppRunner` is ``web.AppRunner`` building this server. The aiohttp
internals used are commented where used; tests/test_http_parser_errors.py pins them.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
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

from skymesh.balancer.errors import describe_http_error, error_response
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.middleware import http_exception_response

log = logging.getLogger("skymesh.balancer")

RequestHandlerFn = Callable[[BaseRequest], Awaitable[web.StreamResponse]]

# aiohttp's message when it lacks the library for a coding it knows: "Can not decode
# content-encoding: brotli (br). Please install `Brotli`" (likewise zstd)
_MISSING_DECODER = re.compile(r"\((?P<coding>[\w.-]+)\)\. Please install")
_HEAD_TOO_LARGE = ("Too many headers", "Too many trailers")


def parser_error_response(exc: BaseException | None, status: int, limits: RequestHandler | None = None) -> web.Response:
    """The JSON answer to a request aiohttp's parser rejected with ``exc``; ``status`` is
    what aiohttp would answer (400 for every parse error; 500/504 for a handler that
    raised, which the middleware answers first). ``limits``: the connection's handler,
    whose size limits a 431 names."""
    detail = describe_http_error(exc) if exc is not None else ""
    if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and exc.message.startswith(_HEAD_TOO_LARGE)):
        # the parser does not say whether the request line or a header was too long
        bound = (f" (limits: request line {limits.max_line_size} bytes, header field {limits.max_field_size}"
                 f" bytes, {limits.max_headers} header fields)" if limits is not None else "")
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


class _BodyErrorsToPayload:
    """Stands in for a connection's HTTP parser: a parse error while the body of a
    request already parsed is arriving (bad chunked framing, a deflate stream cut short)
    is set on that request's body, instead of reaching ``data_received``, which would
    queue an error response behind that request (two responses, or a handler reading the
    body waiting out the body timeout)."""

    __slots__ = ("_parser", "_body", "_failed")

    def __init__(self, parser: Any) -> None:
        self._parser = parser
        self._body: StreamReader | None = None  # the body of the last request parsed
        self._failed = False

    def feed_data(self, data: bytes) -> Any:
        if self._failed:
            return (), False, b""  # the parser stopped at the error; the connection closes
        try:
            result = self._parser.feed_data(data)
        except HttpProcessingError as exc:
            body = self._body
            if body is None or body.is_eof():
                raise  # an error in a request's head: handle_error answers it
            self._failed = True
            failure = RequestPayloadError(describe_http_error(exc))
            failure.__cause__ = exc
            body.set_exception(failure)
            return (), False, b""
        if result[0]:
            self._body = result[0][-1][1]
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, answering its own errors in JSON (module doc)."""

    __slots__ = ("_metrics",)

    def __init__(self, manager: JsonErrorServer, *, loop: asyncio.AbstractEventLoop, **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._metrics = manager.metrics
        # private: aiohttp has no hook between its parser and the queue of parsed requests
        self._parser = _BodyErrorsToPayload(self._parser)

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


def json_http_exceptions(handler: RequestHandlerFn, metrics: BalancerMetrics) -> RequestHandlerFn:
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


class JsonErrorServer(web.Server):
    """``web.Server`` whose connections are :class:`JsonErrorRequestHandler`."""

    def __init__(self, handler: RequestHandlerFn, *, metrics: BalancerMetrics, request_factory: Any = None,
                 handler_cancellation: bool = False, loop: asyncio.AbstractEventLoop | None = None,
                 **kwargs: Any) -> None:
        loop = loop or asyncio.get_running_loop()
        super().__init__(json_http_exceptions(handler, metrics), request_factory=request_factory,
                         handler_cancellation=handler_cancellation, loop=loop, **kwargs)
        self.metrics = metrics
        self._handler_loop = loop
        self._handler_kwargs = kwargs  # RequestHandler's options, as web.Server passes them

    def __call__(self) -> RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._handler_loop, **self._handler_kwargs)


class JsonErrorAppRunner(web.AppRunner):
    """``web.AppRunner`` serving its app with :class:`JsonErrorServer`."""

    __slots__ = ("_metrics",)

    def __init__(self, app: web.Application, *, metrics: BalancerMetrics, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._metrics = metrics

    async def _make_server(self) -> web.Server:
        # private: the one place AppRunner builds its web.Server (after the app's startup)
        made = await super()._make_server()
        return JsonErrorServer(
            made.request_handler, metrics=self._metrics, request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            **made._kwargs,  # private: the RequestHandler options the runner and app gave it
        )
