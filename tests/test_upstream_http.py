"""The lean upstream client (skymesh/balancer/upstream_http.py): what a proxied attempt
reads of an answer, the same as aiohttp's client reads it, and the same errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skymesh.balancer.upstream_http import UpstreamPool, UpstreamResponse, _Connection
from skymesh.runtime.event_loop import ENV_VAR, UVLOOP, loop_name, run_loop
from skymesh.runtime.procs import free_port

RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _raw_server(handler: RawHandler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/completions"


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(keepalive_s=4.0)
    yield p
    await p.close()


async def test_a_streamed_answer_arrives_whole_and_the_connection_is_reused(pool: UpstreamPool) -> None:
    await _three_streams(pool)


def test_the_same_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemons' loop (uvloop's transports are not asyncio's classes)."""
    monkeypatch.delenv(ENV_VAR, raising=False)

    async def on_uvloop() -> str:
        pool = UpstreamPool(keepalive_s=4.0)
        try:
            await _three_streams(pool)
        finally:
            await pool.close()
        return loop_name()

    assert run_loop(on_uvloop()) == UVLOOP


async def _three_streams(pool: UpstreamPool) -> None:
    seen: list[tuple[str, bytes, str]] = []

    async def sse(request: web.Request) -> web.StreamResponse:
        seen.append((request.headers["Content-Type"], await request.read(), request.headers.get("traceparent", "")))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Upstream": "r0"})
        await resp.prepare(request)
        for i in range(5):
            await resp.write(f"data: {i}\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", sse)
    async with TestServer(app) as server:
        url = str(server.make_url("/v1/completions"))
        peers: list[object] = []
        for n in range(3):
            r = await pool.post(url, b'{"n": %d}' % n, {"Content-Type": "application/json", "traceparent": "00-x"},
                                connect_timeout_s=2.0)
            assert r.status == 200
            assert r.headers["content-type"] == "text/event-stream" and r.headers.get("X-Upstream") == "r0"
            body = b""
            while chunk := await r.content.readany():
                body += chunk
            assert body == b"".join(f"data: {i}\n\n".encode() for i in range(5))
            assert r.content.at_eof()
            peers.append(r._conn)
            r.release()
    assert seen == [("application/json", b'{"n": %d}' % n, "00-x") for n in range(3)]
    assert peers[0] is peers[1] is peers[2]  # one keep-alive connection carried all three


async def test_an_error_answer_with_a_length_is_read_whole(pool: UpstreamPool) -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no"}}, status=400)

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    async with TestServer(app) as server:
        url = str(server.make_url("/v1/completions"))
        r = await pool.post(url, b"{}", {}, connect_timeout_s=2.0)
        assert r.status == 400
        assert await r.read() == b'{"error": {"message": "no"}}'
        # not released by the caller (proxy.attempt returns on an error answer): read to
        # its end, the connection went back to the pool by itself and carries the next one
        again = await pool.post(url, b"{}", {}, connect_timeout_s=2.0)
        assert again._conn is r._conn
        assert await again.read() == b'{"error": {"message": "no"}}'


async def test_a_refused_connection_is_aiohttps_connector_error(pool: UpstreamPool) -> None:
    with pytest.raises(aiohttp.ClientConnectorError) as caught:
        await pool.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"{}", {}, connect_timeout_s=2.0)
    assert isinstance(caught.value.os_error, ConnectionRefusedError)


async def test_a_close_before_the_head_is_a_server_disconnect(pool: UpstreamPool) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.close()

    server, url = await _raw_server(hang_up)
    async with server:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await pool.post(url, b"{}", {}, connect_timeout_s=2.0)


async def test_a_close_inside_the_body_is_a_payload_error(pool: UpstreamPool) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    server, url = await _raw_server(cut)
    async with server:
        r = await pool.post(url, b"{}", {}, connect_timeout_s=2.0)
        assert await r.content.readany() == b"data: 1\n\n"
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.content.readany()
        r.release()
        assert pool._idle.get(("127.0.0.1", int(url.split(":")[2].split("/")[0])), []) == []


async def test_a_head_that_does_not_parse_is_aiohttps_processing_error(pool: UpstreamPool) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    server, url = await _raw_server(garbage)
    async with server:
        with pytest.raises(HttpProcessingError):
            await pool.post(url, b"{}", {}, connect_timeout_s=2.0)


async def test_connection_close_and_an_answer_to_the_close_are_not_reused(pool: UpstreamPool) -> None:
    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        # an interim 100, then an answer without length: it ends with the connection
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\":")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"1}")
        writer.close()

    server, url = await _raw_server(answers)
    async with server:
        r = await pool.post(url, b"{}", {}, connect_timeout_s=2.0)
        assert r.status == 200
        assert await r.read() == b'{"a":1}'
        r.release()
        assert not any(pool._idle.values())


async def test_a_slow_reader_pauses_the_socket_and_loses_nothing(pool: UpstreamPool) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB, four times the high-water mark

    async def flood(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(0, len(big), 65536):
            await resp.write(big[i:i + 65536])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", flood)
    async with TestServer(app) as server:
        r = await pool.post(str(server.make_url("/v1/completions")), b"{}", {}, connect_timeout_s=2.0)
        await asyncio.sleep(0.3)  # everything that fits arrives before the first read
        body = b""
        while chunk := await r.content.readany():
            body += chunk
        assert body == big
        r.release()


class _Sink:
    """A connection's answer, fed by hand (no socket)."""

    def __init__(self) -> None:
        self.pool = UpstreamPool(keepalive_s=4.0)
        self.conn = _Connection(self.pool, ("x", 1))

        class _Transport(asyncio.Transport):
            def write(self, data: bytes | bytearray | memoryview) -> None:
                pass

            def is_closing(self) -> bool:
                return False

            def close(self) -> None:
                pass

        self.conn.connection_made(_Transport())

    async def answer(self, pieces: list[bytes]) -> tuple[UpstreamResponse, bytes]:
        head = self.conn.send(b"")
        for piece in pieces:
            self.conn.data_received(piece)
            await asyncio.sleep(0)
        response = await head
        body = b"".join(list(response._chunks))
        return response, body


_CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.binary(min_size=1, max_size=40), max_size=8), cuts=st.lists(st.integers(1, 400), max_size=12))
async def test_chunked_bodies_decode_however_the_bytes_are_split(chunks: list[bytes], cuts: list[int]) -> None:
    wire = _CHUNKED_HEAD + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\nX-T: 1\r\n\r\n"
    points = sorted({c % len(wire) for c in cuts} - {0})
    pieces = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    response, body = await _Sink().answer(pieces)
    assert body == b"".join(chunks)
    assert response._eof


@pytest.mark.parametrize("size", [b"+a", b"-1", b"1_0", b"", b"zz", b"0x1"])
async def test_a_chunk_size_that_is_not_hex_digits_breaks_the_answer(size: bytes) -> None:
    sink = _Sink()
    head = sink.conn.send(b"")
    sink.conn.data_received(_CHUNKED_HEAD + b"1\r\na\r\n" + size + b"\r\n")
    response = await head
    with pytest.raises(aiohttp.ClientPayloadError):
        while await response.readany():
            pass


async def test_headers_are_read_case_blind_first_of_repeats() -> None:
    sink = _Sink()
    head = sink.conn.send(b"")
    sink.conn.data_received(b"HTTP/1.1 503 Service Unavailable\r\ncontent-TYPE: application/json\r\n"
                            b"X-Skymesh-Final: 1\r\nX-Skymesh-Final: 0\r\nContent-Length: 2\r\n\r\n{}")
    response = await head
    assert response.status == 503
    assert response.headers.get("Content-Type") == "application/json"
    assert response.headers["x-skymesh-final"] == "1" and "X-SKYMESH-FINAL" in response.headers
    assert response.headers.get("Missing", "d") == "d"
    assert await response.read() == b"{}"
