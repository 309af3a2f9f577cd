"""One attempt to serve a request upstream (a local replica or a peer balancer): the body
is proxied byte for byte and the answer streamed back chunk by chunk.

The attempt reports what happened as an :class:`AttemptOutcome`; it never decides what
comes next (retry, eject, fail) — that is the region core's job. It does tell the core
``first_token`` *before* the first byte is written to the client, so a request the core
still sees as ``placed`` has sent nothing and can be retried anywhere.

Timeouts mean what they say (:class:`UpstreamTimeouts`): connect; time to the first byte
(for a non-streaming answer, which arrives whole, a total deadline grown with
``max_tokens``); and, once streaming, the longest silence between two chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import aiohttp
from aiohttp import web

from skymesh.balancer.upstream_http import UpstreamPool, UpstreamResponse
from skymesh.balancer.usage import TAIL_BYTES
from skymesh.edge.openai_errors import sse_error_event
from skymesh.routing.harm import Harm

log = logging.getLogger("skymesh.balancer.proxy")

# answers that say "this replica cannot serve it now" rather than "the request is bad"
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
# overload, not sickness: retried elsewhere but not counted towards ejecting the replica
OVERLOAD_STATUSES = frozenset({429, 503})
# on a retryable status: the answer is final, pass it to the client (a peer balancer
# judged the request itself to have made its replica fail: skymesh/routing/harm.py)
FINAL_ANSWER_HEADER = "X-Skymesh-Final"
# a connection dropped sooner than this after the request was sent is not judged against
# the request: a keep-alive connection the server closed just as it was reused fails
# within a round trip, a request that kills its server takes its work's time first
DISCONNECT_JUDGED_AFTER_S = 1.0


class SilenceBound:
    """``async with SilenceBound(limit_s) as watch``: the longest silence of a stream.

    Time counts only while the stream is ``listening``; after ``limit_s`` of it without
    :meth:`heard`, the task is cancelled and the block raises :class:`TimeoutError` (as
    ``asyncio.timeout`` around each read would, which made and cancelled a timer per
    chunk). One timer for the whole stream: when it fires early (something was heard in
    between) it is set again for the time still left."""

    __slots__ = ("_loop", "_limit_s", "_task", "_since", "_handle", "_expired", "_cancelling")

    def __init__(self, limit_s: float) -> None:
        self._limit_s = limit_s
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # None: not listening (the clock is stopped)
        self._handle: asyncio.TimerHandle | None = None
        self._expired = False
        self._cancelling = 0
        task = asyncio.current_task()
        assert task is not None
        self._task = task

    async def __aenter__(self) -> SilenceBound:
        self._cancelling = self._task.cancelling()
        self.heard()
        self._handle = self._loop.call_at(self._loop.time() + self._limit_s, self._check)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def heard(self) -> None:
        """Something arrived, or listening begins: the silence counts from now."""
        self._since = self._loop.time()

    def paused(self) -> None:
        """Not listening (writing to the client): no silence counts until :meth:`heard`."""
        self._since = None

    def _check(self) -> None:
        now = self._loop.time()
        if self._since is None:
            self._handle = self._loop.call_at(now + self._limit_s, self._check)
            return
        due = self._since + self._limit_s
        if now < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._handle = None
        self._expired = True
        self._task.cancel()


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    connect_s: float = 2.0
    # streaming: headers and the first chunk; non-streaming: plus the whole generation
    first_byte_s: float = 60.0
    # a non-streaming answer may take this long per requested token on top of first_byte_s
    # (an upper bound of the replicas' decode time per token, from their profile or config)
    per_output_token_s: float = 0.2
    # once streaming, the longest silence between two chunks
    stream_idle_s: float = 60.0
    # a split request's legs: this multiple of what each is expected to take, within
    # [leg_floor_s, first_byte_s] (config ``upstream.leg_deadline_*``)
    leg_multiple: float = 4.0
    leg_floor_s: float = 10.0

    def first_byte_deadline_s(self, *, stream: bool, max_tokens: int, extra_s: float = 0.0) -> float:
        """``extra_s``: time the target may legitimately queue the request first (a peer
        balancer's own queue-wait bound)."""
        base = self.first_byte_s + extra_s
        return base if stream else base + max_tokens * self.per_output_token_s

    def _leg_bound_s(self, expected_s: float) -> float:
        return min(self.first_byte_s, max(self.leg_floor_s, self.leg_multiple * expected_s))

    def prefill_leg_deadline_s(self, *, predicted_ttft_s: float | None, ttft_target_s: float) -> float:
        """A prefill leg (one token, not streamed): a multiple of its predicted TTFT or
        its TTFT target, whichever is longer — a prefill that far past both is stalled,
        and another replica is its better chance."""
        return self._leg_bound_s(max(predicted_ttft_s or 0.0, ttft_target_s))

    def decode_leg_deadline_s(self, *, transfer_s: float, stream: bool, max_tokens: int) -> float:
        """A decode leg until its first byte: reading the KV (a multiple of the move's
        estimate, at least the floor), then, not streamed, the whole generation."""
        base = self._leg_bound_s(transfer_s)
        return base if stream else base + max_tokens * self.per_output_token_s


class Outcome(Enum):
    SERVED = "served"  # the answer (any status) reached the client
    FAILED_BEFORE_OUTPUT = "failed_before_output"  # nothing reached the client
    FAILED_MIDSTREAM = "failed_midstream"  # the client got part of it and an error event


@dataclass(slots=True)
class AttemptOutcome:
    outcome: Outcome
    response: web.StreamResponse | None = None
    reason: str = ""
    # False for overload answers (429/503): retried, but no mark against the replica
    counts_against_health: bool = True
    # the last bytes of a 200 answer sent to the client in full (where ``usage`` is)
    tail: bytes = b""
    # how the replica failed where a request can be its cause (None: it cannot): the
    # region core judges it (skymesh/routing/harm.py)
    harm: Harm | None = None


class _RelayedAnswer(web.StreamResponse):
    """The client's answer to a proxied request: its head leaves with the first body bytes
    in one write (a plain StreamResponse sends it alone at ``prepare``; aiohttp's own
    ``web.Response`` buffers it the same way, by this class attribute). ``attempt``
    writes the first bytes right after ``prepare``, with no await between."""

    _send_headers_immediately = False


# an upstream's answer: aiohttp's, or the lean client's for plain-http replicas
Upstream = aiohttp.ClientResponse | UpstreamResponse


@dataclass(slots=True)
class AttemptTarget:
    url: str
    headers: dict[str, str]
    session: aiohttp.ClientSession
    # response headers for the client, given the upstream's headers
    client_headers: Callable[[Upstream], dict[str, str]]
    # TLS of the connection (a peer balancer's listener): the context, and the name its
    # certificate must carry; True / None: aiohttp's defaults
    ssl: ssl.SSLContext | bool = True
    server_hostname: str | None = None
    # the lean client's pool (a plain-http replica; skymesh/balancer/upstream_http.py);
    # None: ``session`` sends it
    pool: UpstreamPool | None = None


@functools.lru_cache(maxsize=8)
def _client_timeout(connect_s: float) -> aiohttp.ClientTimeout:
    """aiohttp's timeouts of an attempt (made once per connect bound, not per attempt)."""
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_s)


async def send(target: AttemptTarget, body: bytes, timeouts: UpstreamTimeouts) -> Upstream:
    """POST ``body`` to ``target`` (the lean client for a plain-http replica, else
    aiohttp's) and return the answer once its head arrived."""
    if target.pool is not None:
        return await target.pool.post(target.url, body, target.headers, connect_timeout_s=timeouts.connect_s)
    return await target.session.post(target.url, data=body, headers=target.headers,
                                     timeout=_client_timeout(timeouts.connect_s), ssl=target.ssl,
                                     server_hostname=target.server_hostname)


async def attempt(
    request: web.Request,
    raw: bytes,
    target: AttemptTarget,
    timeouts: UpstreamTimeouts,
    first_byte_deadline_s: float,
    on_first_byte: Callable[[bool], None],
) -> AttemptOutcome:
    """Send ``raw`` to ``target`` and stream the answer to ``request``'s client.

    ``on_first_byte(is_stream)`` runs once, synchronously, right before the first byte is
    written to the client.
    """
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    resp: web.StreamResponse | None = None
    upstream: Upstream | None = None
    try:
        async with asyncio.timeout(first_byte_deadline_s):
            upstream = await send(target, raw, timeouts)
            if upstream.status != 200:
                body = await upstream.read()
                if upstream.status in RETRYABLE_STATUSES and upstream.headers.get(FINAL_ANSWER_HEADER) != "1":
                    return AttemptOutcome(
                        Outcome.FAILED_BEFORE_OUTPUT,
                        reason=f"HTTP {upstream.status}",
                        counts_against_health=upstream.status not in OVERLOAD_STATUSES,
                    )
                # the replica judged the request itself bad: its answer is the result
                on_first_byte(False)
                return AttemptOutcome(
                    Outcome.SERVED,
                    web.Response(body=body, status=upstream.status, content_type="application/json"),
                )
            first = await upstream.content.readany()
        if not first:  # an empty body: nothing was sent, so it counts as a failed attempt
            return AttemptOutcome(Outcome.FAILED_BEFORE_OUTPUT, reason="empty answer")
    except BaseException as e:
        # nothing reached the client: drop the connection, whatever ended the attempt
        if upstream is not None:
            upstream.close()
        if isinstance(e, TimeoutError):  # before OSError: TimeoutError is one
            # not judged against the request: the replica may simply be slow with it (its
            # probes say whether the replica itself went silent)
            return AttemptOutcome(Outcome.FAILED_BEFORE_OUTPUT, reason="no first byte in time")
        if isinstance(e, aiohttp.ClientError | OSError):
            # refused or unreachable: the request never got there
            dropped = (upstream is not None or not isinstance(e, aiohttp.ClientConnectorError)) \
                and loop.time() - sent_at >= DISCONNECT_JUDGED_AFTER_S
            return AttemptOutcome(Outcome.FAILED_BEFORE_OUTPUT, reason=type(e).__name__,
                                  harm=Harm.DISCONNECT if dropped else None)
        raise
    try:
        headers = target.client_headers(upstream)
        on_first_byte("text/event-stream" in headers.get("Content-Type", ""))
        resp = _RelayedAnswer(status=200, headers=headers)
        await resp.prepare(request)
        tail = bytearray(first[-TAIL_BYTES:])
        # the answer's last bytes, when they are in hand with its end, leave with the end of
        # the client's answer in one write (the same bytes as a write and then the end)
        if upstream.content.at_eof():
            await resp.write_eof(first)
            return AttemptOutcome(Outcome.SERVED, resp, tail=bytes(tail))
        await resp.write(first)
        async with SilenceBound(timeouts.stream_idle_s) as silence:
            while True:
                chunk = await upstream.content.readany()  # the silence between chunks is bounded
                if not chunk:
                    break
                tail += chunk
                if len(tail) > 2 * TAIL_BYTES:  # trimmed in halves: amortised O(1) per byte
                    del tail[:-TAIL_BYTES]
                silence.paused()  # a slow client's writes are not the upstream's silence
                if upstream.content.at_eof():
                    await resp.write_eof(chunk)
                    break
                await resp.write(chunk)
                silence.heard()
        await resp.write_eof()  # no-op when the last chunk ended it
        return AttemptOutcome(Outcome.SERVED, resp, tail=bytes(tail[-TAIL_BYTES:]))
    except (TimeoutError, aiohttp.ClientError) as e:
        # after the first byte: end the stream with an error event
        log.warning("upstream failed mid-stream", extra={"target": target.url, "error": repr(e)})
        if resp is not None:
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await resp.write(sse_error_event("upstream failed mid-response"))
                await resp.write_eof()
        return AttemptOutcome(Outcome.FAILED_MIDSTREAM, resp, reason=type(e).__name__)
    finally:
        upstream.release()
