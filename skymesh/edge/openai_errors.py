"""The one builder of OpenAI-shaped errors, ``{"error": {"message", "type", "param",
"code"}}``: the body OpenAI's SDKs parse into their exception types. Every skymesh HTTP
surface (the balancer's client port and peer listener, the HTTP edge, the admin and
metrics guards, the DNS control API) answers its errors through :func:`error_response`
(or :func:`error_body` where the bytes are written by hand); tests/test_error_shape.py
fails on a dict literal of that shape anywhere else. The stand-in replica
(skymesh/replica_sim/) builds vLLM's own error shape on purpose and is not one of them.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

# the error type each status gets unless the caller names another (OpenAI's 401 for an
# API key is "invalid_request_error"; its 429s name the limit: "requests", "tokens")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_exceeded",
    431: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
DEFAULT_ERROR_TYPE = "server_error"


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None, error_type: str | None = None
) -> dict[str, Any]:
    """The error document; ``code`` defaults to the status as a string, ``error_type``
    to :data:`ERROR_TYPES`' entry for the status."""
    return {
        "error": {
            "message": message,
            "type": error_type or ERROR_TYPES.get(status, DEFAULT_ERROR_TYPE),
            "param": param,
            "code": code or str(status),
        }
    }


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    error_type: str | None = None,
) -> web.Response:
    """:func:`error_body` as a JSON response with ``status`` and ``headers``."""
    body = error_body(status, message, code=code, param=param, error_type=error_type)
    return web.json_response(body, status=status, headers=headers)


_DESCRIPTION_CHARS = 300


def describe_http_error(exc: BaseException) -> str:
    """aiohttp's own description of an HTTP parse error on one line (its messages span
    lines to point at the offending byte), bounded in length: for an error message."""
    text = str(getattr(exc, "message", "") or exc)
    text = " ".join(text.split())
    return text if len(text) <= _DESCRIPTION_CHARS else text[: _DESCRIPTION_CHARS - 3] + "..."


# headers of aiohttp's own error response that describe its text/plain body
_BODY_HEADERS = frozenset({"content-type", "content-length", "content-encoding", "transfer-encoding"})
# codes of aiohttp's own HTTP errors (the others get their status as code)
_HTTP_EXCEPTION_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def http_exception_response(e: web.HTTPException) -> web.Response:
    """aiohttp's own HTTP error (status >= 400) as JSON: the same status and headers
    (e.g. ``Allow`` on a 405)."""
    headers = {k: v for k, v in e.headers.items() if k.lower() not in _BODY_HEADERS}
    message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
    return error_response(e.status, message, code=_HTTP_EXCEPTION_CODES.get(e.status), headers=headers or None)


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """What a stream that already started gets when its upstream dies: one SSE error
    event, then the stream ends (no [DONE], so clients can tell it was cut)."""
    payload = error_body(502, message, code=code)
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class RequestError(Exception):
    """A request the balancer refuses while reading it; :meth:`response` is the answer."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> web.Response:
        return error_response(self.status, self.message, code=self.code, param=self.param)
