"""Prefill/decode disaggregation as vLLM 0.32's NixlConnector does it in pull mode, for
the stand-in: a prefill leg (``kv_transfer_params.do_remote_decode``) keeps its KV blocks
after it answers, under a lease, and returns NIXL's ``kv_transfer_params``; a decode leg
(``do_remote_prefill``) reads those blocks from the prefill replica's side channel, waits
the modelled transfer time and starts with the prompt's KV in place.

The "NIXL side channel" is a small HTTP server on the stand-in's host (it carries no KV,
only the bookkeeping a NIXL read implies): ``POST /kv/heartbeat`` extends leases
(vLLM's ``HB:`` notifications), ``POST /kv/read`` completes a read and frees the blocks
(vLLM's completion notification). Leases (``kv_lease_duration``, default 30 s) are wall
clock, as vLLM's: a finished prefill holds its blocks until ``now + lease``; each
heartbeat sets the lease to ``now + 2/3 lease``; expired leases are reaped (counted in
``vllm:nixl_num_kv_expired_reqs``).

A decode stand-in dials only IP literals on 127.0.0.0/8 or the configured peers: any
other ``remote_host`` is treated as invalid KVTransferParams (recomputed, never dialled).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from skymesh.edge.server import site_port

log = logging.getLogger("skymesh.replica_sim")

# vLLM's NIXL side channel handshake waits 5 s for an answer (nixl/base_worker.py)
SIDE_CHANNEL_TIMEOUT_S = 5.0
# the fields NIXL's update_state_after_alloc needs on a decode leg (pull_scheduler.py)
REQUIRED_REMOTE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
LOAD_FAILURE_POLICIES = ("fail", "recompute")
# vllm:nixl_xfer_time_seconds's buckets (nixl/stats.py)
XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def default_engine_id(host: str, port: int) -> str:
    """A stable engine id for a stand-in at host:port (vLLM's default is a uuid4)."""
    digest = hashlib.sha256(f"skymesh-standin:{host}:{port}".encode()).hexdigest()
    return f"{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


@dataclass(frozen=True)
class KVTransferSettings:
    """The stand-in's connector: a NIXL pull connector in role kv_both."""

    side_channel_port: int = 0  # 0: any free port (the one bound is what P returns)
    engine_id: str | None = None  # None: derived from host:port
    lease_s: float = 30.0  # vLLM's kv_lease_duration
    bandwidth_gbps: float = 100.0  # the KV pull's link, Gbit/s
    latency_ms: float = 0.5
    load_failure_policy: str = "fail"  # vLLM's kv_load_failure_policy
    peers: tuple[str, ...] = ()  # hosts a decode leg may dial besides 127.0.0.0/8 literals

    def __post_init__(self) -> None:
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"load_failure_policy must be one of {LOAD_FAILURE_POLICIES}")
        if self.lease_s <= 0 or self.bandwidth_gbps <= 0 or self.latency_ms < 0:
            raise ValueError("lease_s and bandwidth_gbps must be > 0, latency_ms >= 0")
        if not 0 <= self.side_channel_port <= 65535:
            raise ValueError("side_channel_port must be 0-65535")


class TransferFailed(Exception):
    """A KV read that did not complete (unknown request, expired lease, wrong engine,
    side channel unreachable)."""


class PromptStats(Protocol):
    """What the connector metrics read from the engine at scrape time."""

    @property
    def prompt_tokens_total(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def external_tokens_total(self) -> int: ...


class KVTransferMetrics:
    """vLLM's connector metrics, registered only when the stand-in has a connector:
    the scheduler's (``vllm:prompt_tokens_by_source``, ``vllm:external_prefix_cache_*``,
    v1/metrics/loggers.py) and NIXL's (nixl/stats.py)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine_index: str,
                 engine: PromptStats) -> None:
        labels = ("model_name", "engine")
        values = (model_name, engine_index)
        registry.register(_ConnectorCollector(engine, list(values)))
        self.failed_transfers = Counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification failures. "
            "NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
            labels, registry=registry).labels(*values)
        self.expired_reqs = Counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
            labels, registry=registry).labels(*values)
        self.xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
            labels, buckets=XFER_TIME_BUCKETS, registry=registry).labels(*values)


class _ConnectorCollector:
    def __init__(self, engine: PromptStats, label_values: list[str]) -> None:
        self.engine = engine
        self.label_values = label_values
        self.created = time.time()

    def collect(self) -> list[Metric]:
        e = self.engine
        # vLLM queries the connector with every new request's prompt; a hit is a token
        # whose KV arrived from the prefill replica
        external = e.external_tokens_total
        by_source = {"local_compute": e.prompt_tokens_total - e.prefix_cache_hits - external,
                     "local_cache_hit": e.prefix_cache_hits, "external_kv_transfer": external}
        out: list[Metric] = []
        for name, doc, value in (
            ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
             "cross-instance cache sharing, in terms of number of queried tokens.", e.prompt_tokens_total),
            ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
             "cross-instance cache sharing, in terms of number of cached tokens.", external),
        ):
            m = CounterMetricFamily(name, doc, labels=("model_name", "engine"))
            m.add_metric(self.label_values, value, created=self.created)
            out.append(m)
        src = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                  labels=("model_name", "engine", "source"))
        for source in PROMPT_TOKEN_SOURCES:
            src.add_metric([*self.label_values, source], by_source[source], created=self.created)
        out.append(src)
        return out


def allowed_remote(host: Any, port: Any, peers: Sequence[str]) -> bool:
    """May a decode leg dial host:port? Only an IP literal on 127.0.0.0/8 (or ::1), or a
    configured peer; the port an int 1-65535."""
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return False
    if host in peers:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def transfer_seconds(tokens: int, kv_bytes_per_token: int, s: KVTransferSettings) -> float:
    """The modelled pull: latency plus the bytes over the link (unscaled)."""
    return s.latency_ms / 1000.0 + tokens * kv_bytes_per_token * 8 / (s.bandwidth_gbps * 1e9)


class KVTransfer:
    """One stand-in's connector: its side channel (P role), its leases, and its reads
    of other stand-ins' blocks (D role).

    ``release``: frees a held prefill leg's blocks (``Engine.release_held``); ``wake``:
    the engine loop may have work (freed blocks)."""

    def __init__(self, settings: KVTransferSettings, release: Callable[[str], bool], wake: Callable[[], None],
                 metrics: KVTransferMetrics | None) -> None:
        self.settings = settings
        self._release = release
        self._wake = wake
        self.metrics = metrics
        self.engine_id = settings.engine_id or ""
        self.host = "127.0.0.1"
        self.port = 0
        # P role: internal request id -> (lease expiry on the loop clock, tokens computed)
        self.leases: dict[str, tuple[float, int]] = {}
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str, http_port: int) -> None:
        app = web.Application()
        app.router.add_post("/kv/heartbeat", self._heartbeat)
        app.router.add_post("/kv/read", self._read)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, self.settings.side_channel_port, reuse_address=True)
        await site.start()
        self.port = site_port(site)
        self.host = host
        if not self.engine_id:
            self.engine_id = default_engine_id(host, http_port)
        self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())
        log.info("kv transfer side channel listening",
                 extra={"host": host, "port": self.port, "engine_id": self.engine_id})

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ P role

    def lease(self, request_id: str, num_tokens: int) -> None:
        """A finished prefill leg's blocks are held until now + lease."""
        now = asyncio.get_running_loop().time()
        self.leases[request_id] = (now + self.settings.lease_s, num_tokens)

    def drop(self, request_id: str) -> None:
        """Free a held leg at once (its answer never went out)."""
        self.leases.pop(request_id, None)
        if self._release(request_id):
            self._wake()

    def _reap(self) -> None:
        now = asyncio.get_running_loop().time()
        expired = [rid for rid, (until, _) in self.leases.items() if until <= now]
        for rid in expired:
            del self.leases[rid]
            log.warning("Releasing expired KV blocks for request %s", rid)
            self._release(rid)
            if self.metrics is not None:
                self.metrics.expired_reqs.inc()
        if expired:
            self._wake()

    async def _reap_loop(self) -> None:
        period = min(1.0, max(0.01, self.settings.lease_s / 10))
        while True:
            await asyncio.sleep(period)
            self._reap()

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("engine_id") != self.engine_id:
            return web.json_response({"error": "engine id mismatch", "alive": []}, status=409)
        self._reap()
        now = asyncio.get_running_loop().time()
        alive = []
        for rid in body.get("request_ids") or []:
            held = self.leases.get(rid)
            if held is not None:
                self.leases[rid] = (now + self.settings.lease_s * 2 / 3, held[1])
                alive.append(rid)
        return web.json_response({"alive": alive})

    async def _read(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("engine_id") != self.engine_id:
            return web.json_response({"error": "engine id mismatch"}, status=409)
        self._reap()
        rid = body.get("request_id")
        held = self.leases.pop(rid, None) if isinstance(rid, str) else None
        if held is None:
            return web.json_response({"error": f"unknown or expired request {rid!r}"}, status=404)
        self._release(rid)
        self._wake()
        return web.json_response({"num_tokens": held[1]})

    # ------------------------------------------------------------------ D role

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SIDE_CHANNEL_TIMEOUT_S))
        return self._session

    async def _post(self, host: str, port: int, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"
        try:
            async with self._client().post(url, json=payload) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise TransferFailed(str(data.get("error", r.status)) if isinstance(data, dict) else str(r.status))
                return data if isinstance(data, dict) else {}
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            raise TransferFailed(f"side channel {host}:{port}: {e!r}") from None

    async def notify_free(self, params: dict[str, Any]) -> None:
        """vLLM's rejection cleanup: a decode leg refused before the engine sends an empty
        read so the prefill replica frees its blocks at once (failures are only logged)."""
        try:
            await self._post(params["remote_host"], params["remote_port"], "/kv/read",
                             {"engine_id": params["remote_engine_id"], "request_id": params["remote_request_id"]})
        except TransferFailed as e:
            log.info("freeing remote KV of a rejected request failed: %s", e)

    async def pull(self, params: dict[str, Any], seconds: float) -> None:
        """Read a prefill leg's blocks: check its lease (a heartbeat), wait the modelled
        ``seconds`` heartbeating every lease/6, then complete the read (P frees them).
        Raises TransferFailed; counts failures and the transfer time."""
        host, port = params["remote_host"], params["remote_port"]
        engine, rid = params["remote_engine_id"], params["remote_request_id"]
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            hb = {"engine_id": engine, "request_ids": [rid]}
            if rid not in (await self._post(host, port, "/kv/heartbeat", hb)).get("alive", []):
                raise TransferFailed(f"request {rid!r} not held by {engine}")
            end = start + seconds
            beat = self.settings.lease_s / 6
            while (left := end - loop.time()) > 0:
                await asyncio.sleep(min(left, beat))
                if end - loop.time() > 0:
                    await self._post(host, port, "/kv/heartbeat", hb)
            await self._post(host, port, "/kv/read", {"engine_id": engine, "request_id": rid})
        except TransferFailed:
            if self.metrics is not None:
                self.metrics.failed_transfers.inc()
            raise
        if self.metrics is not None:
            self.metrics.xfer_time.observe(loop.time() - start)
