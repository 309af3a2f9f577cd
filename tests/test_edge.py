"""The HTTP edge every skymesh server runs (skymesh/edge/): nothing decoded before the
route and the caller are known, a coded body inflated within bounds, a bounded request
head, capped connections, idle connections closed by the header timeout on the
controller and the DNS control API too. Real servers on loopback, raw sockets."""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.service import ControllerService
from skymesh.balancer.server import Balancer
from skymesh.config import parse_config
from skymesh.dns.embedded import MeshDnsServer
from skymesh.edge import server as edge_server
from skymesh.edge.body import DECODE_STEP_BYTES, BodyRejected, BoundedDecoder
from skymesh.edge.connections import ConnectionLimiter
from skymesh.runtime.procs import free_port
from tests.mesh_helpers import admin_auth, one_region_config
from tests.test_bad_input import EchoReplica
from tests.test_client_auth import KEY, keyed
from tests.test_http_parser_errors import Answer, read_answer

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

GIB = 1024 * 1024 * 1024


def gzip_bomb(inflated_bytes: int) -> bytes:
    """A gzip stream of ``inflated_bytes`` zeros (~1,000:1: 1 GiB is ~1 MB)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1024 * 1024)
    parts = [packer.compress(block) for _ in range(inflated_bytes // len(block))]
    parts.append(packer.flush())
    return b"".join(parts)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return gzip_bomb(GIB)


def raw_request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers.items())]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def exchange(port: int, raw: bytes) -> tuple[Answer, bytes]:
    """One request on a fresh connection: its answer and what followed until EOF."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        answer = await read_answer(reader)
        try:
            rest = await reader.read()
        except ConnectionResetError:  # closed with the unread rest of a refused body
            rest = b""
    finally:
        writer.close()
    return answer, rest


def samples(page: str) -> dict[str, float]:
    return {f"{s.name}{sorted(s.labels.items()) if s.labels else ''}": s.value
            for fam in text_string_to_metric_families(page) for s in fam.samples}


def cpu_seconds() -> float:
    """This process's CPU time (the servers under test run in it)."""
    t = os.times()
    return t.user + t.system


@pytest.fixture
async def balancer() -> AsyncIterator[Balancer]:
    replicas = [EchoReplica()]
    await replicas[0].start()
    data = one_region_config({"r0": replicas[0].url}, free_port(), free_port())
    data["client_auth"] = keyed()
    data["http_limits"] = {"max_connections": 64, "max_connections_per_source": 4, "max_head_bytes": 16384}
    b = Balancer(parse_config(data), "us-east-1")
    await b.start(port=0)
    try:
        yield b
    finally:
        await b.stop()
        await replicas[0].stop()


# ---------------------------------------------------------------------- the bounded decoder


def test_the_decoder_never_holds_more_than_the_limit_nor_makes_more_than_a_step_per_call() -> None:
    stream = gzip_bomb(64 * 1024 * 1024)
    limit = 4 * 1024 * 1024
    decoder = BoundedDecoder("gzip", limit)
    outputs: list[int] = []
    pending = stream[: 64 * 1024]
    with pytest.raises(BodyRejected) as refused:
        while pending:
            out, pending = decoder.feed(pending)
            outputs.append(len(out))
    assert refused.value.status == 413
    assert max(outputs) <= DECODE_STEP_BYTES
    assert limit < decoder.decoded_bytes <= limit + DECODE_STEP_BYTES


@pytest.mark.parametrize("coding, packed", [
    ("gzip", gzip.compress(b'{"a": 1}')),
    ("deflate", zlib.compress(b'{"a": 1}')),
    ("deflate", zlib.compress(b'{"a": 1}')[2:-4]),  # raw deflate, as some clients send it
])
def test_the_decoder_decodes_what_it_accepts(coding: str, packed: bytes) -> None:
    decoder = BoundedDecoder(coding, 1024)
    out = bytearray()
    pending = packed
    while pending:
        chunk, pending = decoder.feed(pending)
        out += chunk
    decoder.finish()
    assert bytes(out) == b'{"a": 1}'


def test_the_connection_limiter_caps_in_all_and_per_source_and_gives_slots_back() -> None:
    limiter = ConnectionLimiter(max_total=3, max_per_source=2)
    assert [limiter.open("a"), limiter.open("a"), limiter.open("a")] == [None, None, "per_source"]
    assert limiter.open("b") is None
    assert limiter.open("c") == "total"
    limiter.close("a")
    assert limiter.open("c") is None
    for source in ("a", "b", "c"):
        limiter.close(source)
    limiter.close("never-opened")
    assert limiter.total == 0 and limiter.held_by("a") == 0


# ---------------------------------------------------------------------- compression bombs


async def test_a_bomb_before_the_credential_check_is_never_inflated(balancer: Balancer, bomb: bytes) -> None:
    """A 1 MB gzip body inflating to 1 GiB, to a path with no route and to the API without
    a key: answered from the head (404, 401); then the same to the API with a key: 413
    once the decoded size passes the body limit. The CPU these take is compared with the
    same requests carrying an incompressible body of the same size (a baseline measured
    here): 1da6a04 inflated the whole GiB in the parser for each (seconds of CPU)."""
    port = balancer.bound_port
    coded = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    plain_body = os.urandom(len(bomb))
    cases = [("/nope", {}, 404), ("/v1/completions", {}, 401),
             ("/v1/completions", {"Authorization": f"Bearer {KEY}"}, 413)]

    async def run(body: bytes, headers: dict[str, str]) -> tuple[float, list[Answer]]:
        start = cpu_seconds()
        answers = []
        for path, extra, _ in cases:
            answer, _rest = await exchange(port, raw_request("POST", path, {**headers, **extra}, body))
            answers.append(answer)
        return cpu_seconds() - start, answers

    plain_cpu, _ = await run(plain_body, {"Content-Type": "application/json"})
    bomb_cpu, answers = await run(bomb, coded)
    assert [a.status for a in answers] == [status for *_, status in cases]
    assert answers[2].json_error()["code"] == "request_too_large"
    assert "decoded" in answers[2].json_error()["message"]
    assert all(a.headers.get("connection", "").lower() == "close" for a in answers[1:])
    # inflating 3 GiB costs seconds; reading 3 MB costs milliseconds either way
    assert bomb_cpu <= 4 * plain_cpu + 0.5, (bomb_cpu, plain_cpu)


async def test_a_coding_not_served_is_a_415_after_the_credential_check(balancer: Balancer) -> None:
    port = balancer.bound_port
    request = raw_request("POST", "/v1/completions", {"Content-Encoding": "br"}, b"abc")
    unauthenticated, _ = await exchange(port, request)
    assert unauthenticated.status == 401
    authed = raw_request("POST", "/v1/completions", {"Content-Encoding": "br", "Authorization": f"Bearer {KEY}"},
                         b"abc")
    answer, rest = await exchange(port, authed)
    assert answer.status == 415
    assert answer.headers["accept-encoding"] == "gzip, deflate"
    assert answer.json_error()["code"] == "unsupported_content_encoding"
    assert rest == b""


async def test_a_gzip_body_within_the_limit_is_served(balancer: Balancer) -> None:
    body = gzip.compress(b'{"model": "skymesh-sim", "prompt": "hello there", "max_tokens": 4}')
    answer, _ = await exchange(balancer.bound_port, raw_request(
        "POST", "/v1/completions", {"Content-Encoding": "gzip", "Content-Type": "application/json",
                                    "Authorization": f"Bearer {KEY}", "Connection": "close"}, body))
    assert answer.status == 200, answer


# ---------------------------------------------------------------------- heads and connections


async def test_an_endless_request_head_is_a_431_at_the_head_bound(balancer: Balancer) -> None:
    """Header fields each under aiohttp's per-field limit, never ending: 1da6a04 buffered
    up to 128 x 8 KB per connection and answered nothing until the header timeout."""
    reader, writer = await asyncio.open_connection("127.0.0.1", balancer.bound_port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sent = 0
        while sent <= 16384 + 8000:  # the fixture's max_head_bytes and one more field
            line = f"X-Pad-{sent}: {'a' * 4000}\r\n".encode()
            writer.write(line)
            sent += len(line)
        await writer.drain()
        answer = await read_answer(reader)
        rest = await reader.read()
    finally:
        writer.close()
    assert answer.status == 431
    assert answer.json_error()["code"] == "request_header_fields_too_large"
    assert "16384 bytes in all" in answer.json_error()["message"]
    assert rest == b""


async def test_connections_over_the_per_source_cap_get_a_503_and_are_counted(
        balancer: Balancer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="skymesh.edge")
    port = balancer.bound_port
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]  # the fixture's cap
    try:
        answer, rest = await exchange(port, b"")  # the server answers before anything is sent
        assert answer.status == 503
        assert answer.json_error()["code"] == "too_many_connections"
        assert answer.headers["connection"].lower() == "close" and rest == b""
        # a held connection still works, and one given back makes room
        reader, writer = held.pop()
        writer.write(raw_request("GET", "/health", {"Connection": "close"}))
        assert (await read_answer(reader)).status == 200
        writer.close()
        await reader.read()
        for _ in range(100):  # the server sees the close on its next loop turns
            answer, _ = await exchange(port, raw_request("GET", "/health", {"Connection": "close"}))
            if answer.status == 200:
                break
            await asyncio.sleep(0.01)
        assert answer.status == 200
    finally:
        for _, writer in held:
            writer.close()
    page = (await exchange(port, raw_request("GET", "/metrics", {"Connection": "close", **admin_auth()})))[0].body
    counted = samples(page.decode())
    assert counted["skymesh_http_connections_refused_total[('reason', 'per_source')]"] >= 1.0
    # and said in the log (one line, not one per refusal)
    refused = [r for r in caplog.records if r.getMessage().startswith("connections refused at the connection cap")]
    assert len(refused) == 1 and refused[0].refused == {"per_source": 1}


def test_the_refusal_log_says_the_first_at_once_and_sums_the_rest_into_the_next_line(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="skymesh.edge")
    clock = [100.0]
    monkeypatch.setattr(edge_server.time, "monotonic", lambda: clock[0])
    refusals = edge_server.RefusalLog(every_s=5.0)
    for _ in range(1000):
        refusals.note("per_source", "127.2.0.7")
    refusals.note("total", "127.2.0.8")
    clock[0] += 5.0
    refusals.note("per_source", "127.2.0.9")
    lines = [r for r in caplog.records if r.name == "skymesh.edge"]
    assert [line.refused for line in lines] == [{"per_source": 1}, {"per_source": 1000, "total": 1}]


# ---------------------------------------------------------------------- the controller and the DNS control API


def edge_config() -> dict[str, Any]:
    data = one_region_config({"r0": "http://127.0.0.1:9"}, free_port(), free_port())
    data["client_timeouts"] = {"header_timeout_s": 0.5}
    return data


async def idle_connection_closed(port: int) -> bytes:
    """Connects, sends nothing, and reads to EOF (1da6a04 held it for an hour)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await reader.read()
    finally:
        writer.close()


async def test_the_controller_closes_a_connection_that_sends_nothing(tmp_path: Any) -> None:
    cfg = parse_config({**edge_config(), "controller": {
        "listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}",
        "state_path": str(tmp_path / "state.db")}})
    controller = ControllerService(cfg)
    await controller.start()
    try:
        assert await idle_connection_closed(controller.bound_ports["http"]) == b""
        page = (await exchange(controller.bound_ports["http"], raw_request(
            "GET", "/metrics", {"Connection": "close", **admin_auth()})))[0].body.decode()
    finally:
        await controller.stop()
    assert "skymesh_http_connections_open" in page


async def test_the_dns_control_api_reads_no_body_before_the_token_and_bounds_it_after(bomb: bytes) -> None:
    cfg = parse_config(edge_config())
    server = MeshDnsServer(cfg)
    await server.start()
    try:
        port = server.bound_ports["control"]
        assert await idle_connection_closed(port) == b""
        token = {"Authorization": f"Bearer {server.peer_token}"}

        async def put_twice(body: bytes, headers: dict[str, str]) -> tuple[float, list[int]]:
            start = cpu_seconds()
            denied, _ = await exchange(port, raw_request("PUT", "/v1/endpoints", headers, body))
            allowed, _ = await exchange(port, raw_request("PUT", "/v1/endpoints", {**headers, **token}, body))
            return cpu_seconds() - start, [denied.status, allowed.status]

        # the same requests with an incompressible body of the same size: the baseline
        plain_cpu, _ = await put_twice(os.urandom(len(bomb)), {"Content-Type": "application/json"})
        bomb_cpu, statuses = await put_twice(bomb, {"Content-Encoding": "gzip", "Content-Type": "application/json"})
        ok, _ = await exchange(port, raw_request(
            "PUT", "/v1/endpoints", {"Authorization": f"Bearer {server.peer_token}", "Connection": "close",
                                     "Content-Type": "application/json"}, b"[]"))
    finally:
        await server.stop()
    assert statuses == [401, 413]
    assert ok.status == 200
    assert bomb_cpu <= 4 * plain_cpu + 0.5, (bomb_cpu, plain_cpu)  # 2 GiB never inflated

