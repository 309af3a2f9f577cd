"""The balancer app's one error middleware: every error it answers is OpenAI-shaped JSON.

* aiohttp's own HTTP errors (no such route 404, wrong method 405, body too large 413,
  a malformed body 400) become ``{"error": {...}}`` with the same status (and the same
  headers, e.g. ``Allow`` on a 405) instead of aiohttp's text/plain pages.
* A body aiohttp cannot read (bad chunked framing, a Content-Encoding that does not
  decode) is the client's fault: a 400 with ``Connection: close``, not the 500 aiohttp
  would make of it. What the parser rejects before the app has a request is answered by
  the server itself (skymesh/edge/server.py), in the same JSON.
* Anything else a handler raises is a bug: one log line with a request id, a count in
  ``skymesh_internal_errors_total``, and a JSON 500 naming that id. Bad input must
  never get here (tests/test_bad_input.py), so the counter is an alarm, not a gauge.

``asyncio.CancelledError`` (the client left; ``handler_cancellation=True``) passes
through untouched: aiohttp and the request's ``finally`` blocks need to see it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import http_exceptions, web

from skymesh.balancer.metrics import BalancerMetrics
from skymesh.edge.openai_errors import describe_http_error, error_response, http_exception_response

log = logging.getLogger("skymesh.balancer")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _started_sending(request: web.Request) -> bool:
    """Whether the status line already went out (a stream had begun): then no error
    response can be sent any more, only the connection closed."""
    writer = request.writer
    return writer is not None and getattr(writer, "output_size", 0) > 0


def make_error_middleware(metrics: BalancerMetrics) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except asyncio.CancelledError:
            raise
        except web.HTTPException as e:
            if e.status < 400:  # redirects and the like are answers, not errors
                raise
            metrics.rejections.labels(str(e.status)).inc()
            return http_exception_response(e)
        except (http_exceptions.HttpProcessingError, web.RequestPayloadError) as e:
            # raised by request.read() for a body whose framing or Content-Encoding is
            # broken (RequestPayloadError wraps the parser's error): the client's fault
            metrics.rejections.labels("400").inc()
            response = error_response(
                400, f"request body could not be read: {describe_http_error(e.__cause__ or e)}")
            response.force_close()  # the parser stopped in the body: nothing more to read here
            return response
        except Exception:
            request_id = f"err-{uuid.uuid4().hex[:16]}"
            metrics.internal_errors.inc()
            log.exception("internal error answering a request",
                          extra={"request_id": request_id, "method": request.method, "path": request.path})
            if _started_sending(request):
                raise  # too late for a response; aiohttp closes the connection
            return error_response(500, f"internal error (request id {request_id})",
                                  code="internal_error", headers={"X-Request-Id": request_id})

    return openai_errors
