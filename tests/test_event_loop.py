"""The daemons' event loop (skymesh/runtime/event_loop.py): uvloop by default, the stdlib
loop when asked or when uvloop cannot load (said once), and gRPC's asyncio API on uvloop."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from skymesh.runtime import event_loop
from skymesh.runtime.event_loop import ENV_VAR, STDLIB, UVLOOP, loop_factory, loop_name, run_loop
from skymesh.runtime.procs import Child, skymesh_cmd


@pytest.fixture(autouse=True)
def _fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_loop, "_fallback_said", False)


async def _which() -> str:
    return loop_name()


def test_uvloop_is_the_default() -> None:
    name, factory = loop_factory({})
    assert name == UVLOOP
    loop = factory()
    try:
        assert loop_name(loop) == UVLOOP
    finally:
        loop.close()


def test_the_environment_chooses_the_stdlib_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    assert loop_factory({ENV_VAR: "asyncio"})[0] == STDLIB
    assert loop_factory({ENV_VAR: " UVLOOP "})[0] == UVLOOP
    monkeypatch.setenv(ENV_VAR, STDLIB)
    assert run_loop(_which()) == STDLIB
    monkeypatch.setenv(ENV_VAR, UVLOOP)
    assert run_loop(_which()) == UVLOOP


def test_an_unknown_choice_runs_the_stdlib_loop_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="skymesh.runtime.event_loop"):
        assert loop_factory({ENV_VAR: "tokio"})[0] == STDLIB
    assert "'tokio'" in caplog.text


def test_uvloop_that_cannot_load_falls_back_and_says_why_once(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    monkeypatch.delenv(ENV_VAR, raising=False)
    with caplog.at_level(logging.WARNING, logger="skymesh.runtime.event_loop"):
        assert run_loop(_which()) == STDLIB
        assert run_loop(_which()) == STDLIB
    said = [r for r in caplog.records if "uvloop unavailable" in r.getMessage()]
    assert len(said) == 1
    assert "cannot import uvloop" in said[0].getMessage()


def test_run_loop_returns_the_result_and_raises_the_error() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async def answers() -> int:
        await asyncio.sleep(0)
        return 7

    assert run_loop(answers()) == 7
    with pytest.raises(ValueError, match="boom"):
        run_loop(fails())


async def _grpc_round_trip() -> tuple[str, bytes, list[bytes]]:
    """A unary call and a bidirectional stream through grpc.aio, server and client in this loop."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request + b"!"

    async def shout(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for message in requests:
            yield message.upper()

    handler = grpc.method_handlers_generic_handler("skymesh.test.Loop", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Shout": grpc.stream_stream_rpc_method_handler(shout),
    })
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            answer = await channel.unary_unary("/skymesh.test.Loop/Echo")(b"hello", timeout=30)
            call = channel.stream_stream("/skymesh.test.Loop/Shout")(iter([b"a", b"bc"]), timeout=30)
            streamed = [m async for m in call]
    finally:
        await server.stop(None)
    return loop_name(), answer, streamed


def test_grpc_aio_serves_and_calls_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert run_loop(_grpc_round_trip()) == (UVLOOP, b"hello!", [b"A", b"BC"])
    # and again on the stdlib loop in the same process (the test suite's own loops)
    monkeypatch.setenv(ENV_VAR, STDLIB)
    assert run_loop(_grpc_round_trip()) == (STDLIB, b"hello!", [b"A", b"BC"])


async def test_the_stand_in_daemon_runs_on_uvloop(tmp_path: Path) -> None:
    """A daemon started as the mesh starts it says which loop it runs (one line at start)."""
    child = Child("replica", skymesh_cmd("replica-sim", "--host", "127.0.0.1", "--port", "0", "--profile",
                                         "tiny-test", "--time-scale", "0.01", "--log-level", "INFO"), tmp_path)
    child.start()
    try:
        await child.wait_ready()
    finally:
        await child.stop()
    lines = [json.loads(line) for line in child.log_path.read_text().splitlines() if line.startswith("{")]
    said = [line.get("event_loop") for line in lines if line.get("logger") == "skymesh.runtime.event_loop"]
    assert said == [UVLOOP]
