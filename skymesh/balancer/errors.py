"""OpenAI-shaped error responses."""

from __future__ import annotations

import json

from aiohttp import web

_TYPES = {
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


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code or str(status),
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.json_response(error_body(status, message, param, code), status=status, headers=headers)


_DESCRIPTION_CHARS = 300


def describe_http_error(exc: BaseException) -> str:
    """aiohttp's own description of an HTTP parse error on one line (its messages span
    lines to point at the offending byte), bounded in length: for an error message."""
    text = str(getattr(exc, "message", "") or exc)
    text = " ".join(text.split())
    return text if len(text) <= _DESCRIPTION_CHARS else text[: _DESCRIPTION_CHARS - 3] + "..."


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """What a stream that already started gets when its upstream dies: one SSE error
    event, then the stream ends (no [DONE], so clients can tell it was cut)."""
    payload = error_body(502, message, code=code)
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.param, self.code)
