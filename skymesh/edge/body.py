"""Request bodies read with bounds, after the caller is known.

Every skymesh HTTP server runs with aiohttp's ``auto_decompress`` off (edge/server.py):
its parser would inflate a ``Content-Encoding: gzip`` body synchronously inside
``data_received``, before any route or credential is checked, so one 1 MB request
inflating to 1 GiB held the event loop for seconds. Here a body is read only when a
handler or a middleware past the credential check asks for it, and inflated by
:class:`BoundedDecoder`: zlib with ``max_length`` per call, so each step produces at most
``DECODE_STEP_BYTES`` and the loop is yielded to between steps; the decoded size counts
against the same limit as the raw size. zlib is the library; only the bounding loop is
written here (aiohttp's decoder has no output bound per call).
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass

from aiohttp import web

from skymesh.edge.openai_errors import error_response

# at most this many decoded bytes per zlib call (one step between yields to the loop)
DECODE_STEP_BYTES = 256 * 1024
SUPPORTED_CODINGS = ("gzip", "x-gzip", "deflate", "identity")


class BodyRejected(Exception):
    """The body cannot be accepted: ``response`` is the OpenAI-shaped answer (the
    connection closes after it: the rest of the body is not read)."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.response = error_response(status, message, code=code, headers=headers)
        self.response.force_close()


def _too_large(limit: int, decoded: bool) -> BodyRejected:
    what = "decoded request body" if decoded else "request body"
    return BodyRejected(413, f"{what} exceeds {limit} bytes", "request_too_large")


def unsupported_coding(coding: str) -> BodyRejected:
    return BodyRejected(
        415, f"Content-Encoding {coding!r} is not supported (gzip and deflate are)",
        "unsupported_content_encoding", headers={"Accept-Encoding": "gzip, deflate"},
    )


class BoundedDecoder:
    """Inflates one gzip or deflate stream fed in pieces, never holding more than
    ``limit`` decoded bytes and never producing more than ``step`` bytes per call."""

    def __init__(self, coding: str, limit: int, step: int = DECODE_STEP_BYTES) -> None:
        self.coding = coding
        self.limit = limit
        self.step = step
        self.decoded_bytes = 0
        self._first = True
        self._zlib = self._make(coding)

    @staticmethod
    def _make(coding: str, raw_deflate: bool = False) -> zlib._Decompress:
        if coding in ("gzip", "x-gzip"):
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        # "deflate" is the zlib format (RFC 9110); some clients send raw deflate, as
        # browsers and aiohttp accept
        return zlib.decompressobj(-zlib.MAX_WBITS if raw_deflate else zlib.MAX_WBITS)

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """Decode from ``data`` at most ``step`` bytes: (decoded, input left over).
        Call again with the leftover (and nothing new) until it is empty."""
        try:
            out = self._zlib.decompress(data, self.step)
        except zlib.error:
            if self._first and self.coding == "deflate":
                # not a zlib header: retry as raw deflate once, on the first piece
                self._first = False
                self._zlib = self._make(self.coding, raw_deflate=True)
                return self.feed(data)
            raise BodyRejected(400, "request body does not decode as its Content-Encoding says",
                               "invalid_content_encoding") from None
        self._first = False
        self.decoded_bytes += len(out)
        if self.decoded_bytes > self.limit:
            raise _too_large(self.limit, decoded=True)
        if self._zlib.eof and self._zlib.unused_data.strip(b"\r\n"):
            raise BodyRejected(400, "request body has bytes after its compressed stream", "invalid_content_encoding")
        return out, self._zlib.unconsumed_tail

    def finish(self) -> None:
        """The body ended: the compressed stream must have ended with it."""
        if not self._zlib.eof:
            raise BodyRejected(400, "request body ends inside its compressed stream", "invalid_content_encoding")


def content_coding(request: web.BaseRequest) -> str:
    """The request's one content coding (lower case; "identity" when none), or the 415
    for a coding not served here (or a list of several)."""
    coding = request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
    if coding not in SUPPORTED_CODINGS:
        raise unsupported_coding(coding)
    return coding


async def read_bounded(request: web.BaseRequest, limit: int) -> bytes:
    """The whole body, decoded: at most ``limit`` bytes raw and ``limit`` decoded, the
    loop yielded to between decode steps. Raises :class:`BodyRejected`. Afterwards
    ``request.read()``, ``.text()`` and ``.json()`` return it (aiohttp keeps a body read
    once; ``_read_bytes`` is where, pinned by tests/test_edge.py)."""
    coding = content_coding(request)
    decoder = BoundedDecoder(coding, limit) if coding != "identity" else None
    body = bytearray()
    raw_bytes = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        raw_bytes += len(chunk)
        if raw_bytes > limit:
            raise _too_large(limit, decoded=False)
        if decoder is None:
            body += chunk
            continue
        pending = chunk
        while pending:
            out, pending = decoder.feed(pending)
            body += out
            if pending:
                await asyncio.sleep(0)  # one step per turn of the loop: /health stays fast
    if decoder is not None:
        decoder.finish()
    data = bytes(body)
    request._read_bytes = data  # type: ignore[attr-defined]  # private: see docstring
    return data


@dataclass(frozen=True, slots=True)
class BodyLimits:
    max_body_bytes: int
    body_timeout_s: float


async def read_body_or_reject(request: web.BaseRequest, limits: BodyLimits) -> web.Response | None:
    """Read ``request``'s body within its limits; the answer to send instead when it
    cannot be (413, 415, 400, or 408 when it does not arrive within the timeout), with
    the connection closed after it."""
    try:
        if request.content.is_eof() and content_coding(request) == "identity":
            # the whole body came with the head (most requests): nothing left to wait for,
            # so no timer (an encoded body keeps it: its decoding yields to the loop)
            await read_bounded(request, limits.max_body_bytes)
            return None
        async with asyncio.timeout(limits.body_timeout_s):
            await read_bounded(request, limits.max_body_bytes)
    except TimeoutError:
        response = error_response(
            408, f"the request body did not arrive within {limits.body_timeout_s:g} s", code="request_timeout")
        response.force_close()
        return response
    except BodyRejected as rejected:
        return rejected.response
    return None
