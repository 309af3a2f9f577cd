"""The open-loop load generator of the live benchmark.

Arrivals are replayed on their (already rate-scaled) times and never wait for responses:
each request is its own task, started when its time comes. Every response is streamed
(OpenAI SSE) and the client records TTFT (first content chunk), the gaps between content
chunks (inter-token times), end-to-end latency, the HTTP status, and the serving
region/replica/offload marker from the headers the skymesh balancer adds
(``X-Skymesh-Region``, ``X-Skymesh-Replica``, ``X-Skymesh-Offloaded``). Bounded: at most
``len(trace)`` requests, and everything still open after ``timeout_s`` is cancelled.

Beside the generator: :class:`LoadSampler` (the balancers' per-replica load while a
replay runs) and :func:`prefix_hit_rate` (the replicas' prefix-cache counters after it).

A request whose trace region names a specific entry point goes to that URL (clients per
region reach their own balancer); the client-side latency to it is the entry point's
business (the local mesh puts a delay proxy in front of each balancer).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from skymesh.bench.traces import TraceRequest
from skymesh.runtime.prom_text import parse_samples
from skymesh.security.admin_auth import admin_headers
from skymesh.word_tokenizer import trace_prompt

# how long the load generator keeps an idle connection: under the servers' keep-alive
# (skymesh's client_timeouts.header_timeout_s, 10 s by default)
CLIENT_IDLE_S = 4.0


@dataclass(slots=True)
class LiveResult:
    arrival_s: float
    input_len: int
    output_len: int
    origin: str = ""
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    rejected: bool = False
    error: str = ""
    region: str = ""
    replica: str = ""
    offloaded: bool = False
    late_s: float = 0.0  # how late the generator sent it (a sign of an overloaded client)
    slo_class: str = ""  # the class it asked for in X-SLO-Class ("" for none)


def _content_events(buf: bytearray) -> tuple[int, bool]:
    """Count complete SSE ``data:`` events with content in ``buf`` and drop them from it;
    returns (events, saw [DONE])."""
    n = 0
    done = False
    while True:
        i = buf.find(b"\n\n")
        if i < 0:
            return n, done
        ev = bytes(buf[:i])
        del buf[: i + 2]
        if ev.startswith(b"data: [DONE]"):
            done = True
        elif ev.startswith(b"data: {") and b'"choices":[]' not in ev:  # not the usage chunk
            n += 1


async def send_one(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, res: LiveResult,
                   model: str = "skymesh-sim", headers: Mapping[str, str] | None = None,
                   include_usage: bool = False) -> None:
    """``include_usage``: ask for the stream's usage chunk (the balancer then judges its
    cached-token prediction against the replica's count)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                            "ignore_eos": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    sent = time.perf_counter()
    try:
        async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
            res.status = r.status
            res.region = r.headers.get("X-Skymesh-Region", "")
            res.replica = r.headers.get("X-Skymesh-Replica", "")
            res.offloaded = r.headers.get("X-Skymesh-Offloaded", "0") == "1"
            if r.status != 200:
                res.rejected = True
                res.error = (await r.text())[:200]
                return
            buf = bytearray()
            last = sent
            async for chunk in r.content.iter_any():
                buf += chunk
                n, _ = _content_events(buf)
                if n == 0:
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - sent
                else:
                    res.itl.append(now - last)
                last = now
                res.tokens += n
            res.e2e = time.perf_counter() - sent
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        res.rejected = res.ttft is None
        res.error = f"{type(e).__name__}: {e}"[:200]


async def replay(trace: Sequence[TraceRequest], url_for: Callable[[TraceRequest], str], timeout_s: float,
                 on_done: Callable[[], None] | None = None,
                 source_for: Callable[[TraceRequest], str | None] | None = None) -> list[LiveResult]:
    """Open loop: send every request of ``trace`` at its arrival time (relative to now).

    ``source_for`` names the client's source address per request (a client *in* its
    region: the local mesh's delay proxies tell regions apart by source network)."""
    results = [LiveResult(r.arrival_s, r.input_len, r.output_len, origin=r.region, slo_class=r.slo_class)
               for r in trace]
    tasks: list[asyncio.Task[None]] = []
    deadline = time.perf_counter() + timeout_s
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    sessions: dict[str | None, aiohttp.ClientSession] = {}

    def session_for(r: TraceRequest) -> aiohttp.ClientSession:
        src = source_for(r) if source_for is not None else None
        s = sessions.get(src)
        if s is None:
            # idle connections are dropped before a skymesh server's keep-alive timer (its
            # header timeout, 10 s by default) closes them: reusing one the server is closing
            # at that instant fails the request (ServerDisconnectedError), aiohttp's 15 s
            # default raced it on quiet stretches of a day
            conn = aiohttp.TCPConnector(limit=0, local_addr=(src, 0) if src else None,
                                        keepalive_timeout=CLIENT_IDLE_S)
            s = sessions[src] = aiohttp.ClientSession(connector=conn, timeout=timeout)
        return s

    try:
        t0 = time.perf_counter()
        for r, res in zip(trace, results, strict=True):
            if time.perf_counter() >= deadline:
                break
            delay = r.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            res.late_s = max(0.0, (time.perf_counter() - t0) - r.arrival_s)
            prompt = trace_prompt(r.hash_ids, r.input_len)
            headers = {"X-Session-ID": str(r.session)}
            if r.slo_class:
                headers["X-SLO-Class"] = r.slo_class
            task = asyncio.create_task(send_one(session_for(r), url_for(r), prompt, r.output_len, res,
                                                headers=headers))
            if on_done is not None:
                task.add_done_callback(lambda _t: on_done())
            tasks.append(task)
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    finally:
        for t in tasks:  # still open at the deadline, or an error above
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in sessions.values():
            await s.close()
    for res in results[len(tasks):]:
        res.rejected = True
        res.error = "not sent: time limit"
    return results


class LoadSampler:
    """Samples the skymesh balancers' view of their replicas while a replay runs: every
    ``every_s`` wall seconds, each replica's pending prefill tokens from the balancers'
    ``/admin/status`` (DualMap's load, for the load CV and the per-replica load plot).
    Peer routers expose no such view: no status URLs, no samples.

    ``samples``: (trace seconds since start, {replica id: pending prefill tokens})."""

    def __init__(self, status_urls: Sequence[str], every_s: float, time_scale: float = 1.0,
                 admin_token: str | None = None) -> None:
        self.status_urls = list(status_urls)
        # /admin/status needs the admin token (default: the environment's)
        self.admin_token = admin_token or os.environ.get("SKYMESH_ADMIN_TOKEN")
        self.every_s = every_s
        self.time_scale = time_scale
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoadSampler:
        if self.status_urls:
            self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.every_s))
        async with aiohttp.ClientSession(timeout=timeout, headers=admin_headers(self.admin_token)) as s:
            while not self._stop.is_set():
                snap: dict[str, int] = {}
                for u in self.status_urls:
                    try:
                        async with s.get(u) as r:
                            doc = await r.json()
                    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                        continue  # a balancer that does not answer this round: no sample from it
                    for rid, v in doc.get("replicas", {}).items():
                        # a region of several balancers: each says what it sent the replica
                        snap[rid] = snap.get(rid, 0) + int(v.get("pending_prefill_tokens", 0))
                if snap:
                    self.samples.append(((loop.time() - t0) / self.time_scale, snap))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.every_s)


class ReplicaWaitingSampler:
    """Max of every replica's ``vllm:num_requests_waiting`` while it runs (every 50 ms):
    what selective pushing bounds (a fleet of balancers must keep it within one budget)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.max_waiting: dict[str, float] = dict.fromkeys(urls, 0.0)
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while True:
                for u in self.urls:
                    with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                        async with s.get(u + "/metrics") as r:
                            for line in (await r.text()).splitlines():
                                if line.startswith("vllm:num_requests_waiting"):
                                    self.max_waiting[u] = max(self.max_waiting[u], float(line.split()[-1]))
                                    self.samples += 1
                await asyncio.sleep(0.05)

    def take(self) -> float:
        """The max over every replica since the last take (then start afresh)."""
        top = max(self.max_waiting.values())
        self.max_waiting = dict.fromkeys(self.urls, 0.0)
        return top

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def prefix_hit_rate(urls: list[str]) -> float | None:
    """Token hit rate from the replicas' vLLM prefix-cache counters."""
    q = h = 0.0
    async with aiohttp.ClientSession() as s:
        for u in urls:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(u + "/metrics") as r:
                    m = parse_samples(await r.text(),
                                      ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"))
                    q += m.get("vllm:prefix_cache_queries_total", 0.0)
                    h += m.get("vllm:prefix_cache_hits_total", 0.0)
    return h / q if q else None
