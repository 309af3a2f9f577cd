"""A proxied stream (skymesh/balancer/proxy.py): the bound on its silence between chunks
(SilenceBound: one timer per stream, the same answers as ``asyncio.timeout`` around each
read), the bytes the client gets through either upstream client, and how they are written."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from skymesh.balancer.proxy import (
    AttemptOutcome,
    AttemptTarget,
    Outcome,
    SilenceBound,
    UpstreamTimeouts,
    attempt,
)
from skymesh.balancer.upstream_http import UpstreamPool
from skymesh.balancer.usage import TAIL_BYTES
from skymesh.edge.openai_errors import sse_error_event


async def test_a_silent_stream_ends_in_a_timeout() -> None:
    with pytest.raises(TimeoutError):
        async with SilenceBound(0.05):
            await asyncio.Event().wait()  # nothing ever arrives


async def test_a_stream_that_keeps_talking_is_not_cut() -> None:
    # 1.5 s of chunks 50 ms apart under a 1 s bound: the silence never reaches it
    async with SilenceBound(1.0) as silence:
        for _ in range(30):
            await asyncio.sleep(0.05)
            silence.heard()


async def test_no_silence_counts_while_paused() -> None:
    # a slow client's write (paused) of four times the bound is not the upstream's silence
    async with SilenceBound(0.05) as silence:
        silence.paused()
        await asyncio.sleep(0.2)
        silence.heard()


async def test_silence_after_a_pause_still_counts() -> None:
    with pytest.raises(TimeoutError):
        async with SilenceBound(0.05) as silence:
            silence.paused()
            await asyncio.sleep(0.1)
            silence.heard()
            await asyncio.Event().wait()


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    started = asyncio.Event()

    async def stream() -> None:
        async with SilenceBound(60.0):
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(stream())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_a_timeout_leaves_the_task_uncancelled() -> None:
    # as asyncio.timeout: the TimeoutError is caught and the task goes on, not cancelling
    with pytest.raises(TimeoutError):
        async with SilenceBound(0.01):
            await asyncio.sleep(10)
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    await asyncio.sleep(0)  # still runs


async def _proxied(upstream_chunks: list[tuple[float, bytes]], hang: bool, idle_s: float,
                   lean: bool, writes: list[bytes] | None = None) -> tuple[bytes, AttemptOutcome]:
    """A client's answer through proxy.attempt from an upstream that writes each chunk after
    its delay (then hangs, or ends), and the attempt's outcome; ``lean``: sent by the lean
    client (skymesh/balancer/upstream_http.py), else by aiohttp's."""

    async def upstream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delay, chunk in upstream_chunks:
            await asyncio.sleep(delay)
            await resp.write(chunk)
        if hang:
            await asyncio.Event().wait()
        await resp.write_eof()
        return resp

    outcomes: list[AttemptOutcome] = []

    async def balancer(request: web.Request) -> web.StreamResponse:
        if writes is not None:  # what the balancer writes to its client, write by write
            transport = request.transport
            assert transport is not None
            write = transport.write

            def recorded(data: bytes) -> None:
                writes.append(bytes(data))
                write(data)

            transport.write = recorded  # type: ignore[method-assign]
        target = AttemptTarget(str(up.make_url("/v1/completions")), {"Content-Type": "application/json"}, session,
                               lambda u: {"Content-Type": u.headers.get("Content-Type", "")},
                               pool=pool if lean else None)
        outcome = await attempt(request, b"{}", target, UpstreamTimeouts(stream_idle_s=idle_s), 30.0,
                                lambda is_stream: None)
        outcomes.append(outcome)
        assert outcome.response is not None
        return outcome.response

    up_app = web.Application()
    up_app.router.add_post("/v1/completions", upstream)
    front_app = web.Application()
    front_app.router.add_post("/v1/completions", balancer)
    pool = UpstreamPool(keepalive_s=4.0)
    try:
        async with TestServer(up_app) as up, TestServer(front_app) as front, aiohttp.ClientSession() as session, \
                session.post(front.make_url("/v1/completions"), data=b"{}") as r:
            body = await r.read()
    finally:
        await pool.close()
    return body, outcomes[0]


@pytest.mark.parametrize("lean", [True, False], ids=["lean-client", "aiohttp-client"])
async def test_an_upstream_silent_mid_stream_ends_the_answer_with_an_error_event(lean: bool) -> None:
    body, outcome = await _proxied([(0, b"data: one\n\n")], hang=True, idle_s=0.1, lean=lean)
    assert outcome.outcome is Outcome.FAILED_MIDSTREAM and outcome.reason == "TimeoutError"
    assert body.startswith(b"data: one\n\n")
    assert body[len(b"data: one\n\n"):] == sse_error_event("upstream failed mid-response")


@pytest.mark.parametrize("lean", [True, False], ids=["lean-client", "aiohttp-client"])
async def test_an_upstream_that_keeps_talking_is_served_whole(lean: bool) -> None:
    chunks = [(0.0, b"data: one\n\n")] + [(0.02, f"data: {i}\n\n".encode()) for i in range(20)]
    body, outcome = await _proxied(chunks, hang=False, idle_s=1.0, lean=lean)
    assert outcome.outcome is Outcome.SERVED
    assert body == b"".join(c for _, c in chunks)
    assert outcome.tail == body[-TAIL_BYTES:]


@pytest.mark.parametrize("lean", [True, False], ids=["lean-client", "aiohttp-client"])
async def test_an_answer_in_one_piece_is_passed_on_whole(lean: bool) -> None:
    # the first chunk may arrive with the answer's end: it leaves with the client's end
    whole = b'data: {"choices":[{"text":"hi"}],"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n'
    body, outcome = await _proxied([(0.0, whole)], hang=False, idle_s=1.0, lean=lean)
    assert outcome.outcome is Outcome.SERVED
    assert body == whole and outcome.tail == whole


async def test_the_answers_head_leaves_with_its_first_bytes() -> None:
    writes: list[bytes] = []
    chunks = [(0.0, b"data: one\n\n"), (0.05, b"data: two\n\n")]
    body, outcome = await _proxied(chunks, hang=False, idle_s=1.0, lean=True, writes=writes)
    assert outcome.outcome is Outcome.SERVED and body == b"data: one\n\ndata: two\n\n"
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert writes[0].endswith(b"\r\n\r\nb\r\ndata: one\n\n\r\n")  # one write: the head and the first chunk
