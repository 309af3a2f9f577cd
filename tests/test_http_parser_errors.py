"""What aiohttp's HTTP parser rejects, and bodies that break after their request was
handed to the app, get one OpenAI-shaped JSON error each (skymesh/edge/server.py):
raw socket clients against a live balancer on two fake replicas. Every case asserts the
status, the JSON shape and content type, ``Connection: close`` where the server closes,
exactly one response on the connection, the count in ``skymesh_rejections_total`` and
no aiohttp error in the logs.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.server import Balancer
from skymesh.config import parse_config
from skymesh.edge import server as http_server
from skymesh.edge.server import (
    EdgeAppRunner,
    EdgeLimits,
    EdgeRequestHandler,
    EdgeServer,
    parser_error_response,
)
from skymesh.runtime.procs import free_port
from tests.mesh_helpers import one_region_config
from tests.test_bad_input import EchoReplica, error_shape_problem

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
async def balancer() -> AsyncIterator[Balancer]:
    replicas = [EchoReplica(), EchoReplica()]
    for r in replicas:
        await r.start()
    data = one_region_config({f"r{i}": r.url for i, r in enumerate(replicas)}, free_port(), free_port())
    b = Balancer(parse_config(data), "us-east-1")
    await b.start(port=0)
    try:
        yield b
    finally:
        await b.stop()
        await asyncio.gather(*(r.stop() for r in replicas))


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json_error(self) -> dict:
        assert self.headers.get("content-type", "").startswith("application/json"), self
        assert error_shape_problem(self.body) is None, self
        return json.loads(self.body)["error"]


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """The next final response (a ``100 Continue`` is skipped)."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        if status >= 200:
            return Answer(status, headers, await reader.readexactly(int(headers.get("content-length", "0"))))


async def rejections(port: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
        page = await r.text()
    return {m[1]: float(m[2]) for m in re.finditer(r'^skymesh_rejections_total\{status="(\d+)"\} (\S+)$', page, re.M)}


def aiohttp_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("aiohttp") and r.levelno >= logging.WARNING]


def request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: balancer\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode() + b"\r\n" + body


def deflate_cut_short() -> bytes:
    """A zlib stream that decodes as far as it goes and then ends early."""
    return zlib.compress(json.dumps({"model": "skymesh-sim", "prompt": "hello there"}).encode())[:8]


# ---------------------------------------------------------------------- what the parser rejects

CL3 = {"Content-Length": "3"}
HEAD_CASES = {
    "request line": (b"GARBAGE\r\n\r\n", 400, "invalid_request_line"),
    "method": (b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_request_line"),
    "version": (b"GET / HTTP/9\r\nHost: x\r\n\r\n", 400, "invalid_request_line"),
    "tls on the http port": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", 400, "invalid_request_line"),
    "header without colon": (b"GET /health HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n", 400, "invalid_request"),
    "non-token header name": (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n", 400, "invalid_request"),
    "nul in a header value": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400, "invalid_request"),
    "header line too long": (request("GET", "/health", {"X-Long": "a" * 9000}), 431,
                             "request_header_fields_too_large"),
    "too many headers": (request("GET", "/health", {f"X-H{i}": "v" for i in range(200)}), 431,
                         "request_header_fields_too_large"),
    "request line too long": (request("GET", "/" + "a" * 9000, {}), 431, "request_header_fields_too_large"),
    "content-length not a number": (request("POST", "/v1/completions", {"Content-Length": "abc"}), 400,
                                    "invalid_request"),
    "content-length twice": (request("POST", "/v1/completions", {**CL3, "content-length": "3"}, b"abc"), 400,
                             "invalid_request"),
    "chunked and content-length": (request("POST", "/v1/completions", {"Transfer-Encoding": "chunked", **CL3},
                                           b"0\r\n\r\n"), 400, "invalid_request"),
    "bad chunk size": (request("POST", "/v1/completions", {"Transfer-Encoding": "chunked"}, b"ZZ\r\nabc\r\n0\r\n\r\n"),
                       400, "invalid_request"),
    "br": (request("POST", "/v1/completions", {"Content-Encoding": "br", **CL3}, b"abc"), 415,
           "unsupported_content_encoding"),
    "zstd": (request("POST", "/v1/completions", {"Content-Encoding": "zstd", **CL3}, b"abc"), 415,
             "unsupported_content_encoding"),
    # a coded body to a route that does not read it is never decoded: tests/test_edge.py
    "deflate cut short": (request("POST", "/v1/completions", {"Content-Encoding": "deflate",
                                                              "Content-Length": str(len(deflate_cut_short()))},
                                  deflate_cut_short()), 400, "invalid_content_encoding"),
}


@pytest.mark.parametrize("name", list(HEAD_CASES))
async def test_a_request_the_parser_rejects_gets_one_counted_json_error(
    balancer: Balancer, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    raw, status, code = HEAD_CASES[name]
    port = balancer.bound_port
    before = await rejections(port)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        answer = await read_answer(reader)
        rest = await reader.read()  # to EOF: the server closes after a parse error
    finally:
        writer.close()
    assert answer.status == status
    error = answer.json_error()
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert answer.headers["connection"].lower() == "close"
    if status == 415:
        assert answer.headers["accept-encoding"] == "gzip, deflate"
    assert rest == b"", f"a second response: {rest[:200]!r}"
    after = await rejections(port)
    assert after.get(str(status), 0) == before.get(str(status), 0) + 1
    assert aiohttp_errors(caplog) == []


# ---------------------------------------------------------------------- bodies that break after the head


async def test_bad_framing_after_the_head_is_a_400_to_the_request_that_reads_it(
    balancer: Balancer, caplog: pytest.LogCaptureFixture
) -> None:
    """The head is handed to the app (``100 Continue`` says so), then the chunked body
    breaks: the handler reading it gets a JSON 400 at once (not the body timeout's 408),
    and no second response follows."""
    port = balancer.bound_port
    before = await rejections(port)
    for body in (b"3\r\n{\"a\r\nZZ\r\n", b"3\r\n{\"a\r\n3\r\nbc\r\n"):  # a bad size; a chunk without its CRLF
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request("POST", "/v1/completions", {"Transfer-Encoding": "chunked",
                                                             "Content-Type": "application/json",
                                                             "Expect": "100-continue"}))
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
            writer.write(body)
            answer = await read_answer(reader)
            rest = await reader.read()
        finally:
            writer.close()
        assert answer.status == 400
        assert "could not be read" in answer.json_error()["message"]
        assert answer.headers["connection"].lower() == "close"
        assert rest == b""
    assert (await rejections(port)).get("400", 0) == before.get("400", 0) + 2
    assert aiohttp_errors(caplog) == []


@pytest.mark.parametrize("encoding, body", [
    ("gzip", b"not gzip at all"),  # fails as it decodes
    ("deflate", deflate_cut_short()),  # decodes, then ends early
])
async def test_a_body_that_does_not_decode_after_the_head_is_a_400(
    balancer: Balancer, caplog: pytest.LogCaptureFixture, encoding: str, body: bytes
) -> None:
    port = balancer.bound_port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request("POST", "/v1/completions", {"Content-Encoding": encoding,
                                                         "Content-Length": str(len(body)),
                                                         "Expect": "100-continue"}))
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
        writer.write(body)
        answer = await read_answer(reader)
        rest = await reader.read()
    finally:
        writer.close()
    assert answer.status == 400
    assert answer.json_error()["code"] == "invalid_content_encoding"  # edge/body.py's decoder
    assert answer.headers["connection"].lower() == "close"
    assert rest == b""
    assert aiohttp_errors(caplog) == []


@pytest.mark.parametrize("method, path, status", [
    ("POST", "/nope", 404),  # no route
    ("POST", "/health", 405),  # a route, not for this method
    ("GET", "/health", 200),  # a GET endpoint, which does not read a body
])
@pytest.mark.parametrize("encoding, body", [
    ("gzip", b"not gzip at all"),
    ("deflate", deflate_cut_short()),
    ("chunked", b"3\r\nabc\r\nZZ\r\n"),
])
@pytest.mark.parametrize("body_later", [False, True], ids=["one-packet", "body-after-answer"])
async def test_a_broken_body_on_a_route_that_does_not_read_it_gets_one_answer(
    balancer: Balancer, caplog: pytest.LogCaptureFixture, method: str, path: str, status: int,
    encoding: str, body: bytes, body_later: bool,
) -> None:
    """The route answers without reading the body; aiohttp then drains it, and the drain
    fails. Before edge/server.py: "Unhandled exception" in the log and, for a body that
    broke before the route answered, aiohttp's text/plain 400 instead of the answer. A
    coded body is never decoded by a route that does not read it (edge/body.py)."""
    framing = ({"Transfer-Encoding": "chunked"} if encoding == "chunked"
               else {"Content-Encoding": encoding, "Content-Length": str(len(body))})
    port = balancer.bound_port
    before = await rejections(port)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request(method, path, framing, b"" if body_later else body))
        if body_later:
            answer = await read_answer(reader)  # the route answered with the body still unsent
            writer.write(body)
        rest = await reader.read()
    finally:
        writer.close()
    if not body_later:
        answer = await read_answer(_reader_of(rest))
        rest = rest[rest.index(b"\r\n\r\n") + 4 + int(answer.headers.get("content-length", "0")):]
        if encoding == "chunked":
            # one packet: the parser fails at the end of the body, before the app has the
            # request (a coded body is not decoded by the parser: the route answers)
            status = 400
    assert answer.status == status
    if status >= 400:
        answer.json_error()
    assert rest == b"", f"a second response: {rest[:200]!r}"
    after = await rejections(port)
    counted = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert counted == ({str(answer.status): 1.0} if answer.status >= 400 else {})
    assert aiohttp_errors(caplog) == []


def _reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_a_bad_expect_header_gets_json(balancer: Balancer) -> None:
    """aiohttp checks ``Expect`` before the middleware runs."""
    port = balancer.bound_port
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/completions", "/nope"):
            async with s.post(f"http://127.0.0.1:{port}{path}", data=b"{}", headers={"Expect": "teapot"}) as r:
                assert r.status == 417
                assert r.content_type == "application/json"
                assert error_shape_problem(await r.read()) is None
        assert (await rejections(port)).get("417") == 2.0


# ---------------------------------------------------------------------- the aiohttp internals used


async def test_the_aiohttp_hooks_http_server_uses_are_still_there() -> None:
    """edge/server.py overrides AppRunner._make_server, reads web.Server._kwargs, wraps
    RequestHandler._parser, sets RequestHandler._force_close and overrides
    RequestHandler.handle_error/log_exception/connection_made/connection_lost: if aiohttp
    renames or reshapes one of them, this fails (and the behaviour tests above)."""
    app = web.Application()
    runner = EdgeAppRunner(app, metrics=BalancerMetrics("r", dict).edge, limits=EdgeLimits(header_timeout_s=7.5),
                           handler_cancellation=True, max_field_size=1234)
    await runner.setup()
    try:
        server = runner.server
        assert isinstance(server, EdgeServer)  # AppRunner.setup still calls _make_server
        assert server.handler_cancellation is True
        protocol = server()
        assert isinstance(protocol, EdgeRequestHandler)
        assert protocol.max_field_size == 1234  # web.Server._kwargs carried the options through
        assert protocol._keepalive_timeout == 7.5  # EdgeLimits.handler_options: the header timeout
        assert protocol._force_close is False
        assert isinstance(protocol._parser, http_server._BoundedParser)
        assert callable(protocol._parser.feed_data) and callable(protocol._parser.message_consumed)
    finally:
        await runner.cleanup()
    for name in ("handle_error", "log_exception", "data_received", "connection_made", "connection_lost"):
        assert callable(getattr(RequestHandler, name, None)), name
    assert list(inspect.signature(RequestHandler.handle_error).parameters) == ["self", "request", "status", "exc",
                                                                               "message"]
    source = inspect.getsource(RequestHandler)
    assert 'log_exception("Unhandled exception", exc_info=exc)' in source
    assert "self._parser.feed_data(data)" in source


def test_an_error_outside_the_app_is_a_json_500_not_a_rejection() -> None:
    response = parser_error_response(RuntimeError("a bug"), 500)
    assert response.status == 500
    assert response.body is not None and error_shape_problem(bytes(response.body)) is None
    assert json.loads(bytes(response.body))["error"]["code"] == "internal_error"
