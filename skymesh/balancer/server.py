"""The regional balancer daemon: OpenAI API in, streaming out.

Request path: validate → hash the prompt once → FCFS queue in :class:`BalancerCore`
(selective pushing) → a dispatcher task places it on an available local replica, or, when
no local replica is available, on a peer region chosen by :class:`OffloadRouter` → the
body is proxied byte for byte and the response streamed back chunk by chunk.

Failure rules: before the first byte reaches the client, a failed replica (or peer) puts
the request back at the head of the queue and it never goes to that replica again; after
the first byte a failure ends the stream with an SSE error event. Accepted work is never
dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from skymesh.balancer.errors import RequestError, error_response, sse_error_event
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.prober import ProbeResult, probe_replica
from skymesh.balancer.requests import parse_body
from skymesh.config import MeshConfig, ReplicaConfig
from skymesh.procs import cancel_tasks
from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.dispatcher import BalancerCore, QueueFull
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.registry import make_policy
from skymesh.tokens import count_tokens

log = logging.getLogger("skymesh.balancer")

HOP_HEADER = "X-Skymesh-Hop"
TOKEN_HEADER = "X-Skymesh-Peer-Token"
ORIGIN_HEADER = "X-Skymesh-Origin-Region"
VERSION = "0.1.0"
# bounded so a peer that keeps failing cannot bounce a request forever
MAX_PLACEMENTS = 6


@dataclass(slots=True)
class Placement:
    kind: str  # "replica" | "peer"
    target: str  # replica id or peer region


@dataclass(slots=True)
class ReplicaInfo:
    replica_id: str
    url: str
    home_region: str
    last_probe: ProbeResult | None = None
    prefix_queries_base: float | None = None
    prefix_hits_base: float | None = None


@dataclass(slots=True)
class PeerInfo:
    region: str
    http_url: str
    grpc_address: str
    alive: bool = True


def _profile_seed(cfg: MeshConfig, replicas: tuple[ReplicaConfig, ...]) -> tuple[float, float]:
    """Seed the TTFT model from the replicas' stand-in profile (refitted online anyway)."""
    from skymesh.replica_sim.profiles import PROFILES

    for r in replicas:
        if r.sim is not None and r.sim.profile in PROFILES:
            p = PROFILES[r.sim.profile]
            per_tok = (p.prefill_time_s(1024) - p.prefill_time_s(512)) / 512 * r.sim.time_scale
            fixed = max(0.0, p.prefill_time_s(512) * r.sim.time_scale - per_tok * 512)
            return per_tok, fixed
    return 300e-3 / 512, 0.02


class Balancer:
    def __init__(
        self,
        cfg: MeshConfig,
        region: str,
        *,
        balancer_id: str | None = None,
        policy_name: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.region_cfg = cfg.region(region)
        self.region = region
        self.balancer_id = balancer_id or f"{region}-{uuid.uuid4().hex[:8]}"
        # epoch bumps on every start so peers can tell a restarted balancer's heartbeats
        self.epoch = time.time_ns() // 1_000_000
        self.policy_name = policy_name or cfg.policy.name
        per_tok, fixed = _profile_seed(cfg, self.region_cfg.replicas)
        ctx = PolicyContext(
            chunk_tokens=cfg.policy.chunk_tokens,
            ttft_slo_s=cfg.policy.ttft_slo_s,
            trie_max_nodes=cfg.policy.trie_max_nodes,
            prefill_s_per_token=per_tok,
            prefill_fixed_s=fixed,
            options=cfg.policy.options,
        )
        self.policy = make_policy(self.policy_name, ctx)
        self.core = BalancerCore(
            self.policy,
            queue_bound=cfg.policy.queue_bound,
            dispatch_budget=cfg.policy.options.dispatch_budget,
            max_retries=cfg.policy.max_retries,
        )
        self.replicas: dict[str, ReplicaInfo] = {}
        self.wake = asyncio.Event()
        self.set_replicas(
            [ReplicaInfo(r.id, r.url, region) for r in self.region_cfg.replicas]
        )
        rtt = {
            r.name: cfg.rtt_ms(region, r.name) / 1000 for r in cfg.regions if r.name != region
        }
        self.offload = OffloadRouter(
            region,
            rtt,
            allowed=cfg.offload.allowed,
            max_remote_queue=cfg.offload.max_remote_queue,
            heartbeat_interval_s=cfg.offload.heartbeat_interval_s,
            miss_limit=cfg.offload.heartbeat_miss_limit,
            trie_max_nodes=max(1000, cfg.policy.trie_max_nodes // 4),
            enabled=cfg.offload.enabled,
        )
        self.peers: dict[str, PeerInfo] = {
            r.name: PeerInfo(r.name, r.balancer.advertise_url, str(r.balancer.grpc_advertise))
            for r in cfg.regions
            if r.name != region
        }
        self.metrics = BalancerMetrics(self)
        self.waiters: dict[str, asyncio.Future[Placement]] = {}
        self.offloaded_out = 0
        self.offloaded_in = 0
        self.controller_connected = False
        self.topology_version = 0
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task[Any]] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._egress: aiohttp.ClientSession | None = None
        self._stopping = False
        self.extra_services: list[Any] = []  # peer mesh / controller link (started by main)

    # ------------------------------------------------------------------ membership

    def set_replicas(self, infos: list[ReplicaInfo]) -> None:
        """Replace the set of replicas this balancer owns (from YAML or the controller)."""
        old = self.replicas
        self.replicas = {}
        for info in infos:
            prev = old.get(info.replica_id)
            if prev is not None and prev.url == info.url:
                prev.home_region = info.home_region
                self.replicas[info.replica_id] = prev
            else:
                self.replicas[info.replica_id] = info
        self.core.set_replicas(list(self.replicas))
        self.wake.set()

    # ------------------------------------------------------------------ lifecycle

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.policy.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/status", self._admin_status)
        return app

    async def start(self, host: str | None = None, port: int | None = None) -> None:
        listen = self.region_cfg.balancer.listen
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        egress_addr = self.region_cfg.egress_source
        econn = aiohttp.TCPConnector(
            limit=0, local_addr=(egress_addr, 0) if egress_addr else None
        )
        self._egress = aiohttp.ClientSession(connector=econn, auto_decompress=False)
        # handler_cancellation: a client that goes away frees its queue slot or replica at once
        self._runner = web.AppRunner(
            self.make_app(), access_log=None, handle_signals=False, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, host or listen.host, listen.port if port is None else port, reuse_address=True
        )
        await site.start()
        self._tasks.append(asyncio.create_task(self._probe_loop(), name="probe"))
        self._tasks.append(asyncio.create_task(self._dispatch_loop(), name="dispatch"))
        for svc in self.extra_services:
            await svc.start()
        log.info(
            "balancer started",
            extra={"region": self.region, "balancer_id": self.balancer_id, "listen": str(listen)},
        )

    @property
    def bound_port(self) -> int:
        assert self._runner is not None
        for site in self._runner.sites:
            server = getattr(site, "_server", None)
            if server is not None and server.sockets:
                return int(server.sockets[0].getsockname()[1])
        return self.region_cfg.balancer.listen.port

    async def stop(self) -> None:
        self._stopping = True
        for svc in reversed(self.extra_services):
            with contextlib.suppress(Exception):
                await svc.stop()
        await cancel_tasks(self._tasks)
        if self._runner is not None:
            await self._runner.cleanup()
        for s in (self._session, self._egress):
            if s is not None:
                await s.close()

    # ------------------------------------------------------------------ probing

    async def _probe_loop(self) -> None:
        interval = self.cfg.policy.probe_interval_s
        timeout = max(0.5, interval * 5)
        assert self._session is not None
        while True:
            started = asyncio.get_running_loop().time()
            infos = list(self.replicas.values())
            results = await asyncio.gather(
                *(probe_replica(self._session, i.url, timeout) for i in infos)
            )
            for info, res in zip(infos, results, strict=True):
                self._apply_probe(info, res)
            self.wake.set()
            elapsed = asyncio.get_running_loop().time() - started
            await asyncio.sleep(max(0.0, interval - elapsed))

    def _apply_probe(self, info: ReplicaInfo, res: ProbeResult) -> None:
        if self.replicas.get(info.replica_id) is not info:
            return  # membership changed while probing
        info.last_probe = res
        if res.healthy:
            if info.prefix_queries_base is None or res.prefix_queries < info.prefix_queries_base:
                # first sight, or the replica restarted (counters reset)
                info.prefix_queries_base = res.prefix_queries
                info.prefix_hits_base = res.prefix_hits
        self.core.update_replica(
            info.replica_id,
            healthy=res.healthy,
            num_running=res.num_running,
            num_waiting=res.num_waiting,
            kv_usage=res.kv_usage,
        )

    def prefix_hit_ratio(self) -> float:
        q = h = 0.0
        for info in self.replicas.values():
            p = info.last_probe
            if p is None or not p.healthy or info.prefix_queries_base is None:
                continue
            q += p.prefix_queries - info.prefix_queries_base
            h += p.prefix_hits - (info.prefix_hits_base or 0.0)
        return h / q if q > 0 else 0.0

    # ------------------------------------------------------------------ dispatching

    async def _dispatch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.cfg.policy.probe_interval_s
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=interval)
            self.wake.clear()
            try:
                self._dispatch_once(loop.time())
            except Exception:  # a bug here must not stop the whole balancer
                log.exception("dispatch failed")

    def _dispatch_once(self, now: float) -> None:
        t0 = time.perf_counter()
        placed = self.core.dispatch(now)
        if placed:
            self.metrics.decision_seconds.observe((time.perf_counter() - t0) / len(placed))
        for req, decision in placed:
            assert decision.replica_id is not None
            self.metrics.observe_decision(req, decision)
            self._resolve(req.request_id, Placement("replica", decision.replica_id), now)
        if self.core.queue_length and not self.core.any_available():
            self._offload_queued(now)

    def _offload_queued(self, now: float) -> None:
        chosen: list[tuple[RoutingRequest, str]] = []
        for req in self.core.queued_requests():
            if req.forwarded:
                continue
            region = self.offload.choose(req, now)
            if region is None:
                if not self.offload.candidates(now):
                    break  # no peer has room: stop scanning
                continue
            self.offload.on_forwarded(req, region, now)
            chosen.append((req, region))
        self.core.take_for_offload(r.request_id for r, _ in chosen)
        for req, region in chosen:
            self.offloaded_out += 1
            self.metrics.offloaded.inc("out", region)
            self._resolve(req.request_id, Placement("peer", region), now, offloaded=True)

    def _resolve(self, request_id: str, placement: Placement, now: float, offloaded: bool = False) -> None:
        fut = self.waiters.pop(request_id, None)
        if fut is None or fut.done():
            # the client left while it was queued: release what the core just booked
            if not offloaded:
                self.core.on_complete(request_id, False, now)
            return
        fut.set_result(placement)

    # ------------------------------------------------------------------ HTTP handlers

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "skymesh"}
                ],
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _admin_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.admin_status())

    def admin_status(self) -> dict[str, Any]:
        now = asyncio.get_running_loop().time()
        snap = self.core.snapshot()
        replicas = {}
        for rid, info in self.replicas.items():
            v = snap["replicas"].get(rid, {})
            replicas[rid] = {"url": info.url, "home_region": info.home_region, **v}
        return {
            "region": self.region,
            "balancer_id": self.balancer_id,
            "epoch": self.epoch,
            "version": VERSION,
            "policy": self.policy_name,
            "queue_length": snap["queue_length"],
            "in_flight": snap["in_flight"],
            "offloaded_out": self.offloaded_out,
            "offloaded_in": self.offloaded_in,
            "prefix_hit_ratio": round(self.prefix_hit_ratio(), 4),
            "replicas": replicas,
            "peers": self.offload.snapshot_state(now),
            "controller_connected": self.controller_connected,
            "topology_version": self.topology_version,
            "counters": snap["counters"],
            "policy_stats": snap["policy"],
        }

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(
                    413, f"request body exceeds {self.cfg.policy.max_body_bytes} bytes"
                ) from None
            forwarded = HOP_HEADER in request.headers
            if forwarded and request.headers.get(TOKEN_HEADER) != self.cfg.peer_token:
                raise RequestError(401, "forwarded request without a valid peer token")
            parsed = parse_body(raw, kind, self.cfg.model)
        except RequestError as e:
            self.metrics.rejections.inc(str(e.status))
            return e.response()
        now = loop.time()
        req = RoutingRequest(
            request_id=f"{self.region}-{next(self._ids)}-{os.getpid()}",
            chunk_hashes=prompt_chunk_hashes(parsed.prompt, self.cfg.policy.chunk_tokens),
            prompt_tokens=count_tokens(parsed.prompt),
            arrival=now,
            max_tokens=parsed.max_tokens,
            session_key=request.headers.get("X-Session-ID") or parsed.user,
            forwarded=forwarded,
        )
        if forwarded:
            self.offloaded_in += 1
            self.metrics.offloaded.inc("in", request.headers.get(ORIGIN_HEADER, "unknown"))
        try:
            self._enqueue(req, front=False)
        except QueueFull as e:
            self.metrics.rejections.inc("429")
            retry_after = max(1, round(self.cfg.policy.ttft_slo_s))
            return error_response(
                429, str(e), code="queue_full", headers={"Retry-After": str(retry_after)}
            )
        try:
            return await self._serve(request, raw, req)
        finally:
            fut = self.waiters.pop(req.request_id, None)
            if fut is not None and not fut.done():
                fut.cancel()
            # no-op when the request completed; frees its queue slot or replica otherwise
            self.core.cancel(req.request_id, loop.time())
            self.wake.set()

    def _enqueue(self, req: RoutingRequest, front: bool) -> None:
        self.waiters[req.request_id] = asyncio.get_running_loop().create_future()
        try:
            self.core.submit(req, front=front)
        except QueueFull:
            self.waiters.pop(req.request_id, None)
            raise
        self.wake.set()

    async def _serve(self, request: web.Request, raw: bytes, req: RoutingRequest) -> web.StreamResponse:
        slo_wait = max(60.0, self.cfg.policy.ttft_slo_s * 30)
        for _ in range(MAX_PLACEMENTS):
            fut = self.waiters[req.request_id]
            try:
                placement = await asyncio.wait_for(asyncio.shield(fut), timeout=slo_wait)
            except TimeoutError:
                self.metrics.rejections.inc("504")
                return error_response(504, "timed out waiting for a replica", code="queue_timeout")
            outcome = await self._attempt(request, raw, req, placement)
            if isinstance(outcome, web.StreamResponse):
                return outcome
            # failed before the first byte: it is queued again (or out of retries)
            if outcome == "exhausted":
                break
            self.metrics.retries.inc(placement.kind)
        self.metrics.rejections.inc("502")
        return error_response(
            502, "all attempts to reach a replica failed before any output", code="upstream_unavailable"
        )

    async def _attempt(
        self, request: web.Request, raw: bytes, req: RoutingRequest, placement: Placement
    ) -> web.StreamResponse | str:
        loop = asyncio.get_running_loop()
        headers = {"Content-Type": "application/json"}
        if placement.kind == "replica":
            info = self.replicas.get(placement.target)
            if info is None:  # membership changed between placement and now
                return self._requeue_after_failure(req, placement)
            url = info.url + request.path
            session = self._session
        else:
            url = self.peers[placement.target].http_url + request.path
            headers[HOP_HEADER] = "1"
            headers[TOKEN_HEADER] = self.cfg.peer_token
            headers[ORIGIN_HEADER] = self.region
            session = self._egress
        assert session is not None
        try:
            upstream = await session.post(
                url,
                data=raw,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=120.0),
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning("upstream connect failed", extra={"target": placement.target, "error": repr(e)})
            return self._requeue_after_failure(req, placement)
        resp: web.StreamResponse | None = None
        try:
            if upstream.status != 200:
                body = await upstream.read()
                if upstream.status in (429, 500, 502, 503, 504):
                    return self._requeue_after_failure(req, placement)
                # the replica judged the request itself bad: pass its answer through
                self._finish(req, placement, ok=True)
                return web.Response(
                    body=body, status=upstream.status, content_type="application/json"
                )
            out_headers = {
                "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                "X-Skymesh-Region": upstream.headers.get("X-Skymesh-Region", self.region)
                if placement.kind == "peer"
                else self.region,
                "X-Skymesh-Replica": upstream.headers.get("X-Skymesh-Replica", "")
                if placement.kind == "peer"
                else placement.target,
                "X-Skymesh-Offloaded": "1" if placement.kind == "peer" else "0",
                # the regions this request went through, origin first ("a>b" when offloaded)
                "X-Skymesh-Path": f"{self.region}>{upstream.headers.get('X-Skymesh-Path', placement.target)}"
                if placement.kind == "peer"
                else self.region,
                "X-Request-Id": req.request_id,
            }
            stream = "text/event-stream" in out_headers["Content-Type"]
            async for chunk in upstream.content.iter_any():
                if resp is None:
                    if placement.kind == "replica":
                        ttft = self.core.on_first_token(req.request_id, loop.time(), observe=stream)
                        if ttft is not None and stream:
                            self.metrics.observed_ttft.observe(ttft)
                    resp = web.StreamResponse(status=200, headers=out_headers)
                    await resp.prepare(request)
                await resp.write(chunk)
            if resp is None:  # empty body: treat as a failed attempt (nothing was sent)
                return self._requeue_after_failure(req, placement)
            await resp.write_eof()
            self._finish(req, placement, ok=True)
            return resp
        except (TimeoutError, aiohttp.ClientError) as e:
            if resp is None:
                return self._requeue_after_failure(req, placement)
            # after the first byte: end the stream with an error event
            log.warning("upstream failed mid-stream", extra={"target": placement.target, "error": repr(e)})
            self._finish(req, placement, ok=False)
            self.metrics.midstream_failures.inc(placement.kind)
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await resp.write(sse_error_event(f"upstream {placement.target} failed mid-response"))
                await resp.write_eof()
            return resp
        finally:
            upstream.release()

    def _finish(self, req: RoutingRequest, placement: Placement, ok: bool) -> None:
        if placement.kind == "replica":
            self.core.on_complete(req.request_id, ok, asyncio.get_running_loop().time())
            self.wake.set()

    def _requeue_after_failure(self, req: RoutingRequest, placement: Placement) -> str:
        now = asyncio.get_running_loop().time()
        if placement.kind == "replica":
            # the core re-queues it at the head, excluding the failed replica
            if not self.core.retry(req.request_id, now):
                return "exhausted"
            self.waiters[req.request_id] = asyncio.get_running_loop().create_future()
            self.wake.set()
            return "retry"
        # a peer failed or refused before any output: stop using it until its next
        # heartbeat and serve the request here (it keeps its place at the head)
        self.offload.mark_unavailable(placement.target)
        try:
            self._enqueue(req, front=True)
        except QueueFull:
            return "exhausted"
        return "retry"
