"""A lean HTTP/1.1 client for the proxy's attempts on this region's replicas (plain http).

What one proxied request needs of a client, and no more: a keep-alive pool per replica, a
request written in one piece, the answer's head parsed once, its body (chunked, by
length, or to the close) handed to the proxy as it arrives, with flow control. aiohttp's
client does the same with a cookie jar, redirects, tracing signals, a URL object, a
request object and a stream reader fed per parser event around each request, which cost
more per proxied request than the rest of the balancer's proxy path (docs/benchmarks.md,
"Proxy cost").

It answers as aiohttp's ``ClientResponse`` does for what :func:`skymesh.balancer.proxy.attempt`
reads (``status``, ``headers``, ``read``, ``content.readany``, ``content.at_eof``, ``close``,
``release``) and fails with the exceptions aiohttp raises in the same cases, so an
attempt's outcome and its reason (which reach a client's error message) do not depend on
the client: refused or unreachable ``ClientConnectorError``; no connection within the
connect bound ``ConnectionTimeoutError`` (a ``TimeoutError``); closed before a whole head
``ServerDisconnectedError`` (``ClientOSError`` on a reset); closed or broken inside the body
``ClientPayloadError``; a head that does not parse ``HttpProcessingError``.

The request carries the attempt's headers with ``Host`` and ``Content-Length`` only: not
aiohttp's default ``Accept``, ``Accept-Encoding: gzip, deflate`` and ``User-Agent`` (the
answer is relayed as it comes, so it must not come compressed).

Peer balancers (mTLS, the egress source address) and https replicas keep aiohttp's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections import deque
from typing import cast
from urllib.parse import urlsplit

from aiohttp import (
    ClientConnectorError,
    ClientOSError,
    ClientPayloadError,
    ConnectionTimeoutError,
    ServerDisconnectedError,
)
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.http_exceptions import BadStatusLine, HttpProcessingError, LineTooLong

# a head longer than this is refused (aiohttp's client bound: 8190 bytes a line)
MAX_HEAD_BYTES = 64 * 1024
# a chunk-size line longer than this is broken framing
MAX_CHUNK_LINE = 1024
# body bytes held for the proxy before the socket stops being read (until the proxy reads them)
HIGH_WATER = 256 * 1024

_HEX_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _TO_CLOSE, _DONE = range(8)


class UpstreamHeaders(dict[str, str]):
    """An answer's headers by lower-case name (the first of repeated ones), read case
    blind as aiohttp's ``CIMultiDictProxy`` is for what the proxy asks of them."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())


class UpstreamResponse:
    """One answer being read from a pooled connection (module doc). ``content`` is the
    response itself (``readany``, ``at_eof``), as aiohttp's ``content`` stream is."""

    __slots__ = ("status", "headers", "_conn", "_chunks", "_size", "_eof", "_error", "_waiter", "_keep_alive",
                 "_released")

    def __init__(self, conn: _Connection, status: int, headers: UpstreamHeaders, keep_alive: bool) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = keep_alive
        self._released = False

    @property
    def content(self) -> UpstreamResponse:
        return self

    # -- fed by the connection

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _end(self) -> None:
        self._eof = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the proxy

    async def readany(self) -> bytes:
        """What arrived since the last read (waiting for something); b"" at the end. An
        error raises at once, as aiohttp's stream does, even with bytes unread."""
        while True:
            if self._error is not None:
                raise self._error
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._size = 0
                self._conn.resume()  # no-op unless HIGH_WATER paused it
                return data
            if self._eof:
                # read to its end: the connection goes back now, as aiohttp's does at the
                # payload's end (an attempt that returns on an error answer never releases)
                self.release()
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def at_eof(self) -> bool:
        """The whole body arrived and was read."""
        return self._eof and not self._chunks

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection (the answer is abandoned)."""
        self._released = True
        self._conn.close()

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool when the answer was
        read to its end and both sides keep the connection; else it is closed."""
        if self._released:
            return
        self._released = True
        if self._eof and self._error is None and self._keep_alive:
            self._conn.idle()
        else:
            self._conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an upstream: parses one answer at a time."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self._pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._state = _DONE  # no answer expected until a request is sent
        self._buf = bytearray()
        self._remaining = 0
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._paused = False
        self._closed = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance check
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.transport = None
        self._pool.forget(self)
        head = self._head
        if head is not None and not head.done():
            head.set_exception(ClientOSError(*exc.args) if isinstance(exc, OSError) else ServerDisconnectedError())
            head.exception()  # retrieved: the caller may have gone (cancelled) already
        response = self._response
        if response is not None and not response._eof and response._error is None:
            if self._state == _TO_CLOSE:
                response._end()  # a body without length ends with the connection
            else:
                detail = "" if exc is None else f". {exc!r}"
                response._fail(ClientPayloadError(f"Response payload is not completed{detail}"))
        self._state = _DONE

    def data_received(self, data: bytes) -> None:
        try:
            self._parse(data)
        except HttpProcessingError as e:
            if self._head is not None and not self._head.done():
                self._head.set_exception(e)
            elif self._response is not None:
                self._response._fail(ClientPayloadError(f"Response payload is not completed: {e!r}"))
            self._state = _DONE
            self.close()

    # -- the pool's side

    def send(self, request: bytes) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self._state = _HEAD
        self._buf.clear()
        self._response = None
        self._head = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._head

    def usable(self) -> bool:
        return not self._closed and self.transport is not None and not self.transport.is_closing()

    def idle(self) -> None:
        """The answer was read whole: the connection can carry the next request."""
        self._response = None
        self._head = None
        if self._buf or not self.usable():  # bytes after the answer: nothing to reuse
            self.close()
            return
        self.resume()
        self._pool.put(self)

    def close(self) -> None:
        self._closed = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    # -- parsing

    def _parse(self, data: bytes) -> None:
        if self._state == _HEAD:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    raise LineTooLong("response head", str(MAX_HEAD_BYTES), str(len(self._buf)))
                return
            head = bytes(self._buf[:end])
            data = bytes(self._buf[end + 4:])
            self._buf.clear()
            self._start(head)
            if self._state == _HEAD:  # an interim (1xx) answer: the real head follows
                if data:
                    self._parse(data)
                return
        if not data:
            return
        response = self._response
        if response is None:  # bytes nobody asked for
            self._buf += data
            return
        if self._state == _LENGTH:
            if len(data) >= self._remaining:
                body, extra = data[:self._remaining], data[self._remaining:]
                if body:
                    response._feed(body)
                self._state = _DONE
                self._buf += extra
                response._end()
                return
            self._remaining -= len(data)
            response._feed(data)
        elif self._state == _TO_CLOSE:
            response._feed(data)
        elif self._state == _DONE:
            self._buf += data
        else:
            self._chunked(data, response)

    def _start(self, head: bytes) -> None:
        """The answer's head: status, headers, and how its body is framed."""
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise BadStatusLine(lines[0])
        status = int(code)
        headers = UpstreamHeaders()
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise BadStatusLine(line)
            name = name.lower()
            if name not in headers:
                dict.__setitem__(headers, name, value.strip())
        if 100 <= status < 200:
            return  # interim: stay in _HEAD
        connection = headers.get("Connection", "").lower()
        keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        response = self._response = UpstreamResponse(self, status, headers, keep_alive)
        if "chunked" in headers.get("Transfer-Encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif (length := headers.get("Content-Length")) is not None:
            if not length.isdigit():
                raise BadStatusLine(f"Content-Length: {length}")
            self._remaining = int(length)
            self._state = _LENGTH if self._remaining else _DONE
        elif status in (204, 304):
            self._state = _DONE
        else:
            self._state = _TO_CLOSE
            response._keep_alive = False
        if self._state == _DONE:
            response._end()
        assert self._head is not None
        if not self._head.done():
            self._head.set_result(response)

    def _chunked(self, data: bytes, response: UpstreamResponse) -> None:
        """Decode chunked framing: ``data`` read by position (a whole answer often comes in
        one read), what is left of an incomplete line kept for the next read."""
        if self._buf:
            data = bytes(self._buf) + data
            self._buf.clear()
        pos = 0
        end_of_data = len(data)
        out: list[bytes] = []
        try:
            while pos < end_of_data:
                state = self._state
                if state == _CHUNK_DATA:
                    stop = min(pos + self._remaining, end_of_data)
                    out.append(data[pos:stop])
                    self._remaining -= stop - pos
                    pos = stop
                    if not self._remaining:
                        self._state = _CHUNK_END
                elif state == _CHUNK_END:
                    if end_of_data - pos < 2:
                        break
                    if data[pos:pos + 2] != b"\r\n":
                        raise BadStatusLine("chunk not ended by CRLF")
                    pos += 2
                    self._state = _CHUNK_SIZE
                elif state == _CHUNK_SIZE:
                    end = data.find(b"\r\n", pos)
                    if end < 0:
                        if end_of_data - pos > MAX_CHUNK_LINE:
                            raise LineTooLong("chunk size", str(MAX_CHUNK_LINE), str(end_of_data - pos))
                        break
                    size = data[pos:end]
                    if b";" in size:  # a chunk extension: ignored
                        size = size.split(b";", 1)[0].strip()
                    if _HEX_SIZE.fullmatch(size) is None:  # int() would take "+a", "1_0"
                        raise BadStatusLine(f"chunk size {size!r}")
                    length = int(size, 16)
                    start = end + 2
                    stop = start + length
                    if length and data[stop:stop + 2] == b"\r\n":  # the whole chunk is here: one step
                        out.append(data[start:stop])
                        pos = stop + 2
                        continue
                    pos = start
                    self._remaining = length
                    self._state = _CHUNK_DATA if length else _TRAILER
                elif state == _TRAILER:
                    end = data.find(b"\r\n", pos)
                    if end < 0:
                        if end_of_data - pos > MAX_HEAD_BYTES:
                            raise LineTooLong("trailer", str(MAX_HEAD_BYTES), str(end_of_data - pos))
                        break
                    line_empty = end == pos
                    pos = end + 2
                    if line_empty:  # the empty line after the last chunk (and any trailers)
                        self._state = _DONE
                        break
                else:  # _DONE
                    break
            if pos < end_of_data:
                # an incomplete line, or bytes after the answer (then the connection is not reused)
                self._buf += data[pos:]
        finally:
            if out:
                response._feed(out[0] if len(out) == 1 else b"".join(out))
        if self._state == _DONE:
            response._end()


class UpstreamPool:
    """Keep-alive connections to plain-http upstreams, per host and port, without a
    limit (as the aiohttp connector it stands beside: ``limit=0``). An idle connection is
    used again only within ``keepalive_s`` of its last answer (under the upstream's own
    keep-alive, so this side closes first) and is closed after it."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    @staticmethod
    def serves(url: str) -> bool:
        return url.startswith("http://")

    async def post(self, url: str, body: bytes, headers: dict[str, str], *, connect_timeout_s: float) -> UpstreamResponse:
        """Send ``body`` to ``url`` (plain http) and wait for the answer's head."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or 80
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        host_header = host if port == 80 else f"{host}:{port}"
        if ":" in host:  # an IPv6 literal
            host_header = f"[{host}]" if port == 80 else f"[{host}]:{port}"
        lines = [f"POST {target} HTTP/1.1", f"Host: {host_header}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        conn = self._take((host, port)) or await self._connect(host, port, connect_timeout_s)
        try:
            return await conn.send(request)
        except BaseException:
            conn.close()  # cancelled or failed before the head: this connection's answer is unknown
            raise

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        oldest_usable = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if conn.usable() and conn.idle_since >= oldest_usable:
                return conn
            conn.close()
        return None

    async def _connect(self, host: str, port: int, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, (host, port)), host, port)
        except TimeoutError as e:
            raise ConnectionTimeoutError(f"Connection timeout to host http://{host}:{port}") from e
        except OSError as e:
            key = ConnectionKey(host, port, False, True, None, None, None, None)
            raise ClientConnectorError(key, e) from e
        return conn

    def put(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s, self._close_stale)

    def forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def _close_stale(self) -> None:
        """Close the connections idle past ``keepalive_s`` (one timer for the pool, set
        again while any stay idle)."""
        self._sweep = None
        oldest_usable = time.monotonic() - self.keepalive_s
        for idle in self._idle.values():
            for conn in [c for c in idle if c.idle_since < oldest_usable]:
                idle.remove(conn)
                conn.close()
        if any(self._idle.values()):
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s, self._close_stale)

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
