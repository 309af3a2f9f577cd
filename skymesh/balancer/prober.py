"""Replica probing: scrape vLLM's Prometheus page for the signals selective pushing needs."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from skymesh.runtime.clock import loop_clock
from skymesh.runtime.prom_text import parse_sample_counts

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # vLLM before the v1 engine rename
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
_WANTED = (WAITING, RUNNING, KV_USAGE, KV_USAGE_OLD, PREFIX_QUERIES, PREFIX_HITS)
T = TypeVar("T")


@dataclass(slots=True)
class ProbeResult:
    healthy: bool
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    error: str = ""
    sent_at: float | None = None  # the event loop's clock when the scrape was sent
    # the scrape got no answer in time (the replica went silent, not away)
    timed_out: bool = False


# one replica's page as the member of a fleet that probes it shares it: (replica id, result)
SharedPage = tuple[str, ProbeResult]


def parse_probe(text: str) -> ProbeResult:
    """The probe signals of a metrics page; never raises: a page with a missing, NaN,
    infinite or negative value is an unhealthy result (a replica we cannot read is one we
    must not route to), not an exception that would stop the probe loop."""
    s = parse_sample_counts(text, _WANTED)
    if WAITING not in s or RUNNING not in s:
        return ProbeResult(healthy=False, error="metrics page lacks vllm:num_requests_* gauges")
    for name, (value, _) in s.items():
        if not math.isfinite(value) or value < 0:
            return ProbeResult(healthy=False, error=f"metrics page has {name} = {value}")
    # one series per engine (vLLM labels each engine="N"; several with data parallelism):
    # requests and prefix counters add up, the KV-cache usage is the engines' mean
    kv_total, kv_series = s.get(KV_USAGE, s.get(KV_USAGE_OLD, (0.0, 1)))
    return ProbeResult(
        healthy=True,
        num_running=int(s[RUNNING][0]),
        num_waiting=int(s[WAITING][0]),
        kv_usage=kv_total / kv_series,
        prefix_queries=s.get(PREFIX_QUERIES, (0.0, 0))[0],
        prefix_hits=s.get(PREFIX_HITS, (0.0, 0))[0],
    )


async def probe_replica(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> ProbeResult:
    try:
        async with session.get(
            base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                return ProbeResult(healthy=False, error=f"HTTP {resp.status}")
            # undecodable bytes become U+FFFD: the page then fails to parse as numbers and
            # the result is unhealthy, instead of an exception out of the probe loop
            return parse_probe(await resp.text(errors="replace"))
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return ProbeResult(healthy=False, error=type(e).__name__, timed_out=isinstance(e, TimeoutError))


# the most bytes of a /v1/models answer read (a model list is a few hundred bytes)
MODELS_BODY_LIMIT = 1 << 20


async def fetch_max_model_len(session: aiohttp.ClientSession, base_url: str, model: str,
                              timeout_s: float = 5.0) -> int | None:
    """The ``max_model_len`` a replica's ``/v1/models`` reports for ``model`` (vLLM lists
    it per model); None when it cannot be read or makes no sense. Never raises."""
    try:
        async with session.get(base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            body = await resp.content.read(MODELS_BODY_LIMIT + 1)
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None
    if len(body) > MODELS_BODY_LIMIT:
        return None
    try:
        data = json.loads(body)
    except ValueError:  # not JSON, not UTF-8, too deep (RecursionError is not one: below)
        return None
    except RecursionError:
        return None
    entries = data.get("data") if isinstance(data, dict) else None
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and entry.get("id") == model:
            limit = entry.get("max_model_len")
            if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit <= 1 << 24:
                return limit
    return None


async def probe_rounds(session: aiohttp.ClientSession, interval_s: float,
                       targets: Callable[[], Sequence[tuple[T, str]]],
                       on_results: Callable[[Sequence[tuple[T, ProbeResult]]], None]) -> None:
    """Probe every ``(key, base_url)`` of ``targets()`` at once, each round started
    ``interval_s`` after the previous one started; ``on_results`` gets each round's
    answers. Runs until cancelled (under a SupervisedLoop)."""
    loop = asyncio.get_running_loop()
    timeout = max(0.5, interval_s * 5)
    while True:
        started = loop.time()
        sent_at = loop_clock()  # the balancer's clock (the region core's `now`)
        round_targets = list(targets())
        results = await asyncio.gather(*(probe_replica(session, url, timeout) for _, url in round_targets))
        for res in results:
            res.sent_at = sent_at
        on_results([(key, res) for (key, _), res in zip(round_targets, results, strict=True)])
        await asyncio.sleep(max(0.0, interval_s - (loop.time() - started)))
