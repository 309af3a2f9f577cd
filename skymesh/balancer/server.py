"""The regional balancer daemon: OpenAI API in, streaming out.

The daemon only moves bytes and time; every decision is the region core's
(:class:`~skymesh.routing.region.RegionCore`, the same object the simulator drives).
Request path: validate → hash the prompt once → ``core.submit`` → a dispatch round
(``core.tick``) returns where it goes (a local replica, a peer region, or an error) →
:func:`skymesh.balancer.proxy.attempt` proxies the body and streams the answer → the
outcome goes back to the core (``first_token``, ``complete``, ``fail``). The client
leaving at any point is ``client_gone``. See docs/routing.md for the layers.

This module holds one concern, the balancer as a whole: it builds the parts
(wiring.py), owns membership (membership.py) and the lifecycle (start, drain, stop, the
probe and dispatch loops), and is the composition root of the narrow ports the mesh
services use (ports.py): it builds one per service over the parts that port needs
(peer_mesh_port.py, sibling_link_port.py, controller_link_port.py) and hands those to the
services (services.attach_services). The rest is in its own room: request intake
(request_intake.py: parse, origin, SLO class, encode, submit), the serve/retry loop and
outcome accounting (request_flow.py), the HTTP apps (http_surface.py), the status
document (status_report.py).

Failure rules (the core's): before the first byte reaches the client, a failed replica
(or peer) puts the request back at the head of the queue and it never goes to that
replica again; after the first byte a failure ends the stream with an SSE error event.
A replica the health tracker ejects gives up its unstarted requests at once. Accepted
work is never dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import hdrs, web

from skymesh.assembly import region_settings, sibling_settings
from skymesh.balancer.auth import ClientKeyring
from skymesh.balancer.controller_link_port import ControllerLinkPort
from skymesh.balancer.fleet import RegionFleet
from skymesh.balancer.gate import ClientGate
from skymesh.balancer.http_surface import HttpSurface
from skymesh.balancer.kv_events import KvEventSubscriber
from skymesh.balancer.membership import PeerInfo, ReplicaInfo, merge_replicas, prefix_hit_ratio
from skymesh.balancer.metrics import BalancerMetrics, balancer_snapshot
from skymesh.balancer.peer_listener import make_binding_middleware, start_peer_site
from skymesh.balancer.peer_mesh_port import PeerMeshPort
from skymesh.balancer.ports import StatusReport
from skymesh.balancer.prober import ProbeResult, SharedPage, fetch_max_model_len, probe_rounds
from skymesh.balancer.prompt_count import PromptCounter
from skymesh.balancer.proxy import AttemptTarget
from skymesh.balancer.request_flow import (
    HOP_HEADER,
    ORIGIN_HEADER,
    TOKEN_HEADER,
    RequestFlow,
    peer_target,
    replica_target,
)
from skymesh.balancer.request_intake import RequestIntake
from skymesh.balancer.services import loop_restart_counts, sibling_link_counts
from skymesh.balancer.sibling_link_port import SiblingLinkPort
from skymesh.balancer.status_report import build_status_report
from skymesh.balancer.upstream_http import UpstreamPool
from skymesh.balancer.wiring import (
    build_encoder,
    build_region_core,
    chars_per_token_bound,
    upstream_timeouts,
)
from skymesh.config import (
    KvEventsEndpoint,
    MeshConfig,
)
from skymesh.context_window import ContextWindow
from skymesh.edge.server import EdgeAppRunner, EdgeLimits, site_port
from skymesh.routing.base import RoutingRequest
from skymesh.routing.health import ProbeSample
from skymesh.routing.probe_owners import ProbeOwners
from skymesh.routing.region_actions import Action, ForwardToRegion, SendToReplica
from skymesh.runtime.clock import loop_clock
from skymesh.runtime.procs import cancel_tasks, wait_event
from skymesh.runtime.reload_plan import ReloadStatus
from skymesh.runtime.supervise import SupervisedLoop
from skymesh.security.admin_auth import resolve_admin_token, resolve_peer_token
from skymesh.security.pki import balancer_server_name, peer_tls

if TYPE_CHECKING:  # imported only when tracing is on (see Balancer.__init__)
    from skymesh.balancer.tracing import BalancerTracing

log = logging.getLogger("skymesh.balancer")
# seconds an idle connection to a replica or a peer balancer is kept: under uvicorn's
# keep-alive (vLLM, 5 s) and a skymesh server's header timeout (10 s), so the client side
# always closes first (aiohttp's own default, 15 s, raced both)
UPSTREAM_IDLE_S = 4.0


class Balancer:
    def __init__(
        self,
        cfg: MeshConfig,
        region: str,
        *,
        balancer_id: str | None = None,
        policy_name: str | None = None,
        config_sha256: str | None = None,
        static_siblings: Mapping[str, str] | None = None,
        advertise_host: str | None = None,
    ) -> None:
        """``static_siblings``: the region's other balancers the config lists (id -> its
        own gRPC address); the controller's topology may name more. ``advertise_host``:
        where the siblings and the controller reach this balancer (skymesh/balancer/
        identity.py; None: its listen host unless that is a wildcard)."""
        self.cfg = cfg
        # the loaded config file: its SHA-256 (None: not from a file) and when it was loaded
        self.config_sha256 = config_sha256
        self.config_loaded_unix = time.time()
        self.reload_status = ReloadStatus()  # the last SIGHUP reload (skymesh/balancer/reload_rules.py)
        self.region_cfg = cfg.region(region)
        self.region = region
        self.balancer_id = balancer_id or f"{region}-{uuid.uuid4().hex[:8]}"
        # epoch bumps on every start so peers can tell a restarted balancer's heartbeats
        self.epoch = time.time_ns() // 1_000_000
        self.policy_name = policy_name or cfg.policy.name
        self.core = build_region_core(cfg, region, self.policy_name)
        self.policy = self.core.view.policy
        self.offload = self.core.offload
        # the region's other balancers (config or controller) and the budgets shared with them
        self.fleet = RegionFleet(region, self.balancer_id, self.epoch, self.core,
                                 static_members=static_siblings or {}, settings=sibling_settings(cfg.siblings))
        self.fleet.attach_if_needed(loop_clock())
        # which replicas this member scrapes (all of them in a region of one): the others'
        # pages come from the siblings that probe them; a page older than a member's rank
        # times this is probed here too (an owner gone quiet)
        self.probe_owners = ProbeOwners(self.balancer_id, stale_after_s=max(
            3 * cfg.policy.probe_interval_s, 2 * cfg.siblings.keepalive_s))
        self.timeouts = upstream_timeouts(cfg, self.region_cfg.replicas)
        # token-true prompt hashing (the model's tokenizer.json) or the UTF-8 byte fallback
        self.encoder = build_encoder(cfg)
        # refusals of what cannot fit the model, and the bounded counting (prompt_count.py)
        self.max_chars_per_token = chars_per_token_bound(cfg, self.encoder)
        self.counter = PromptCounter(self.encoder, self.context_window, lambda: self.cfg.tokenizer.count_timeout_s)
        # replicas whose /v1/models is being read (their max_model_len)
        self._models_pending: set[str] = set()
        # exact cache state from the replicas' KV events (started with the server)
        self.kv_subscriber: KvEventSubscriber | None = None
        self.replicas: dict[str, ReplicaInfo] = {}
        self.wake = asyncio.Event()
        self.metrics = BalancerMetrics(region, lambda: balancer_snapshot(self))
        # after admission: the serve/retry loop and its accounting (request_flow.py)
        self.flow = RequestFlow(self.core, self.metrics, self.wake, target=self._target,
                                timeouts=lambda: self.timeouts, chunk_tokens=lambda: self.cfg.policy.chunk_tokens,
                                cache_source=self._cache_source,
                                replica_urls=lambda: [info.url for info in self.replicas.values()])
        self.waiters = self.flow.waiters
        self.set_replicas(
            [ReplicaInfo(r.id, r.url, region, r.role) for r in self.region_cfg.replicas]
        )
        # TLS of the peer listener and of forwards (None: no tls section, loopback only)
        self.peer_tls = peer_tls(cfg, region)
        scheme = "http" if self.peer_tls is None else "https"
        self.peers: dict[str, PeerInfo] = {
            r.name: PeerInfo(r.name, r.balancer.advertise_url, str(r.balancer.grpc_advertise),
                             peer_url=None if (pa := r.balancer.peer_advertise) is None
                             else f"{scheme}://{pa.host}:{pa.port}")
            for r in cfg.regions
            if r.name != region
        }
        self._tasks: list[asyncio.Task[Any]] = []
        self._runner: EdgeAppRunner | None = None
        self._peer_runner: EdgeAppRunner | None = None
        self._site: web.TCPSite | None = None  # the client port
        self._peer_site: web.TCPSite | None = None
        self._session: aiohttp.ClientSession | None = None
        self._egress: aiohttp.ClientSession | None = None
        # the attempts on plain-http replicas (skymesh/balancer/upstream_http.py)
        self._upstream: UpstreamPool | None = None
        self._stopping = False
        self.extra_services: list[Any] = []  # peer mesh / controller link (started by main)
        self._dispatch_listeners: list[Callable[[], None]] = []  # called after every dispatch round
        self._loops: list[SupervisedLoop] = []  # probe and dispatch (they count their restarts)
        self._drained = asyncio.Event()  # set when stopping and the last request ended
        # the mesh services' ports (ports.py): what each may ask of this balancer
        self.peer_mesh_port = PeerMeshPort(lambda: self.cfg, region, self.balancer_id, self.epoch, core=self.core,
                                           peers=self.peers, wake=self.wake, apply=self.flow.apply,
                                           services=self.extra_services)
        # trust: client keys and limits, the admin token, slow-client bounds (gate.py)
        self.peer_token = resolve_peer_token(cfg, (self.region_cfg.balancer.listen.host,))
        self.gate = ClientGate(
            cfg, resolve_admin_token(cfg), TOKEN_HEADER, HOP_HEADER, self.peer_token,
            on_reject=lambda status: self.metrics.rejections.labels(str(status)).inc(),
            on_refused_forward=self.peer_mesh_port.count_refused_forward,
        )
        self.sibling_link_port = SiblingLinkPort(
            lambda: self.cfg, region, self.balancer_id, self.epoch, fleet=self.fleet, gate=self.gate,
            probe_owners=self.probe_owners, metrics=self.metrics, wake=self.wake, replicas=lambda: self.replicas,
            apply_probe=self._apply_probe, on_dispatch_round=self._dispatch_listeners.append)
        self.controller_link_port = ControllerLinkPort(
            lambda: self.cfg, region, self.balancer_id, self.epoch, advertise_host=advertise_host,
            fleet=self.fleet, peers=self.peers, region_names=frozenset(r.name for r in cfg.regions),
            peer_mesh_port=self.peer_mesh_port,
            set_replicas=self.set_replicas, set_draining=self.set_draining, replicas=lambda: self.replicas,
            status_report=self.status_report, http_port=lambda: self.bound_port, services=self.extra_services)
        # OpenTelemetry spans of each request (None: tracing off, no span is ever made)
        self.tracing: BalancerTracing | None = None
        if cfg.tracing.enabled:
            # optional: the SDK (~0.2 s to import) is loaded only by a balancer that traces
            from skymesh.balancer.tracing import BalancerTracing

            self.tracing = BalancerTracing(cfg.tracing, region=region, balancer_id=self.balancer_id)
        self.intake = RequestIntake(cfg, region, core=self.core, flow=self.flow, gate=self.gate,
                                   metrics=self.metrics, wake=self.wake, counter=self.counter,
                                   peers=self.peers.keys, on_request_end=self._request_ended,
                                   tracing=self.tracing, stopping=lambda: self._stopping)
        self.http = HttpSurface(intake=self.intake, gate=self.gate, metrics=self.metrics,
                                max_body_bytes=cfg.policy.max_body_bytes, model=lambda: self.cfg.model,
                                admin_status=lambda: self.admin_status(), draining=lambda: self._stopping)

    # ------------------------------------------------------------------ membership

    def set_replicas(self, infos: list[ReplicaInfo]) -> None:
        """Replace the set of replicas this balancer owns (from YAML or the controller)."""
        self.replicas = merge_replicas(self.replicas, infos)
        homes = {rid: info.home_region for rid, info in self.replicas.items()}
        self._apply(self.core.set_replicas(list(self.replicas), loop_clock(), homes))
        # prefill/decode roles: each replica's as its membership source gave it
        self.core.set_roles({rid: info.role for rid, info in self.replicas.items()})
        if self.kv_subscriber is not None:
            self.kv_subscriber.set_replicas(self._kv_endpoints())
        self.wake.set()

    def set_draining(self, replica_ids: list[str]) -> None:
        """The owned replicas that are leaving: no new requests, the ones in flight finish."""
        self.core.set_draining(replica_ids)
        self.wake.set()

    def _cache_source(self, replica_id: str) -> str:
        """What the policy reads this replica's cache from: "events" (its KV events) or
        "routing-history" (what this balancer sent it)."""
        idx = self.core.kv_indexes
        return "routing-history" if idx is None else idx.source_of(replica_id)

    def kv_events_status(self) -> dict[str, Any]:
        """Per replica with a KV-event publisher: its stream and its block index."""
        if self.kv_subscriber is None or self.core.kv_indexes is None:
            return {}
        out: dict[str, Any] = {}
        for rid, stream in self.kv_subscriber.status().items():
            idx = self.core.kv_indexes.by_replica.get(rid)
            out[rid] = {"stream": stream, "index": idx.stats() if idx is not None else None}
        return out

    def _kv_endpoints(self) -> dict[str, KvEventsEndpoint]:
        """The KV-event publishers of the replicas this balancer owns now (adopted ones
        included: every region's replicas are in the config)."""
        by_id = {rep.id: rep.kv_events for r in self.cfg.regions for rep in r.replicas}
        return {rid: ep for rid in self.replicas if (ep := by_id.get(rid)) is not None}

    def apply_config(self, cfg: MeshConfig, keyring: ClientKeyring, admin_token: str | None, *,
                     own_replicas: bool, config_sha256: str | None) -> None:
        """Take a reloaded config whose changes are all live ones (see
        skymesh/balancer/reload_rules.py, which checks that first). Requests in flight and queued
        keep going: a request already in an attempt keeps that attempt's timeouts, and
        every later decision uses the new settings. ``own_replicas``: this balancer owns its
        replica list (no controller); with a controller the topology decides membership."""
        self.gate.reconfigure(cfg, keyring, admin_token)
        self.core.reconfigure(
            region_settings(cfg),
            allowed=cfg.offload.allowed,
            max_remote_queue=cfg.offload.max_remote_queue,
            miss_limit=cfg.offload.heartbeat_miss_limit,
            trigger=cfg.offload.trigger,
            min_gain_s=cfg.offload.min_gain_s,
        )
        region_cfg = cfg.region(self.region)
        self.timeouts = upstream_timeouts(cfg, region_cfg.replicas)
        self.intake.reconfigure(cfg)
        self.cfg, self.region_cfg = cfg, region_cfg
        self.config_sha256 = config_sha256
        self.config_loaded_unix = time.time()
        if own_replicas:
            self.set_replicas([ReplicaInfo(r.id, r.url, self.region, r.role) for r in region_cfg.replicas])
        self.wake.set()  # queued requests: a placement round under the new settings

    def _request_ended(self) -> None:
        if self._stopping and not self.core.view.active_requests:
            self._drained.set()  # the last handler out of a drain

    def sibling_link_counts(self) -> dict[str, int]:
        """The sibling channel's counters (sent, applied, looks, dropped_<reason>, ...)."""
        return sibling_link_counts(self.extra_services)

    def loop_restart_counts(self) -> dict[str, int]:
        """Restarts of this balancer's supervised loops and its services' (by loop name)."""
        counts = {loop.name: loop.restarts for loop in self._loops if loop.restarts}
        for name, n in loop_restart_counts(self.extra_services).items():
            counts[name] = counts.get(name, 0) + n
        return counts

    @property
    def offloaded_out(self) -> int:
        return self.core.offloaded_out

    @property
    def offloaded_in(self) -> int:
        return self.core.offloaded_in

    # ------------------------------------------------------------------ lifecycle

    def make_app(self) -> web.Application:
        app = self.http.client_app()
        app.on_response_prepare.append(self._close_when_stopping)
        return app

    def make_peer_app(self) -> web.Application:
        """The peer listener's app: forwarded requests only (peer_listener.py)."""
        app = self.http.peer_app(make_binding_middleware(
            tls=self.peer_tls is not None, peers=lambda: frozenset(self.peers),
            allowed_origins=self.peer_mesh_port.allowed_origins, origin_header=ORIGIN_HEADER,
            on_refused=self.peer_mesh_port.count_refused_forward))
        app.on_response_prepare.append(self._close_when_stopping)
        return app

    async def _close_when_stopping(self, _request: web.Request, response: web.StreamResponse) -> None:
        """While draining, a request that came on a kept-alive connection is answered with
        ``Connection: close``: its client opens its next connection to a balancer that still
        listens instead of reusing one to a balancer about to exit."""
        if self._stopping:
            response.force_close()  # the server closes the connection after this response
            response.headers[hdrs.CONNECTION] = "close"  # (the headers were prepared already)

    def _make_runner(self, app: web.Application) -> EdgeAppRunner:
        # handler_cancellation: a client that goes away frees its queue slot or replica at once;
        # EdgeAppRunner: bounded heads, connections and bodies, and what aiohttp's HTTP parser
        # rejects answered in JSON too (skymesh/edge/server.py)
        return EdgeAppRunner(
            app, metrics=self.metrics.edge, limits=EdgeLimits.from_config(self.cfg), handler_cancellation=True,
        )

    async def start(self, host: str | None = None, port: int | None = None) -> None:
        listen = self.region_cfg.balancer.listen
        if self.core.kv_indexes is not None:
            self.kv_subscriber = KvEventSubscriber(
                apply=lambda rid, events, max_blocks: self.core.kv_events(rid, events, loop_clock(), max_blocks),
                reset=self.core.kv_stream_reset)
            self.kv_subscriber.set_replicas(self._kv_endpoints())
        elif any(rep.kv_events for rep in self.region_cfg.replicas):
            log.warning("replicas publish KV events but no tokenizer is configured (tokenizer.path): "
                        "prompts are hashed as bytes, which never match token-id blocks; the events are "
                        "not used", extra={"region": self.region})
        # idle upstream connections are dropped before the upstream's own keep-alive closes
        # them (vLLM's uvicorn: 5 s; a peer balancer: its header timeout, 10 s): a request
        # sent on a connection the server is closing at that instant fails for nothing
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=UPSTREAM_IDLE_S)
        self._session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        self._upstream = UpstreamPool(keepalive_s=UPSTREAM_IDLE_S)
        egress_addr = self.region_cfg.egress_source
        econn = aiohttp.TCPConnector(
            limit=0, local_addr=(egress_addr, 0) if egress_addr else None, keepalive_timeout=UPSTREAM_IDLE_S
        )
        self._egress = aiohttp.ClientSession(connector=econn, auto_decompress=False)
        self._runner = self._make_runner(self.make_app())
        await self._runner.setup()
        self._site = web.TCPSite(
            self._runner, host or listen.host, listen.port if port is None else port, reuse_address=True
        )
        await self._site.start()
        if (peer_listen := self.region_cfg.balancer.peer_listen) is not None:
            self._peer_runner = self._make_runner(self.make_peer_app())
            await self._peer_runner.setup()
            self._peer_site = await start_peer_site(self._peer_runner, peer_listen, self.peer_tls,
                                                    f"the {self.region} balancer")
        interval = self.cfg.policy.probe_interval_s
        for name, body in (("probe", self._probe_loop), ("dispatch", self._dispatch_loop)):
            loop = SupervisedLoop(name, body, logger=log, backoff_s=interval, max_backoff_s=max(interval, 2.0))
            self._loops.append(loop)
            self._tasks.append(loop.start())
        for svc in self.extra_services:
            await svc.start()
        log.info(
            "balancer started",
            extra={"region": self.region, "balancer_id": self.balancer_id, "listen": str(listen)},
        )

    @property
    def bound_port(self) -> int:
        # before start: the configured port
        return self.region_cfg.balancer.listen.port if self._site is None else site_port(self._site)

    @property
    def peer_port(self) -> int | None:
        """The port of the peer listener (None: none configured)."""
        return None if self._peer_site is None else site_port(self._peer_site)

    async def stop(self, drain_timeout_s: float = 0.0, drain_listen_s: float = 0.0) -> None:
        """Stop; with ``drain_timeout_s`` > 0 (SIGTERM), drain first: deregister from the
        controller (DNS and this region's replicas move now), fail ``/health`` while still
        serving new connections for ``drain_listen_s`` (so a load balancer in front, whose
        health checks need that long to see it, stops sending it connections before its
        listener closes: a connection the kernel accepted just before the close would be
        reset), stop accepting, keep probing and dispatching so every accepted request
        (queued or in flight) can finish, for at most ``drain_timeout_s``; then stop the rest."""
        self._stopping = True
        if drain_timeout_s > 0 and self._runner is not None:
            # deregister first: the controller moves DNS and this region's replicas to the
            # nearest live balancer while this one still finishes what it accepted
            for svc in self.extra_services:
                prepare = getattr(svc, "prepare_drain", None)
                if prepare is not None:
                    try:
                        await prepare()
                    except Exception:  # a bug there must not stop the drain itself
                        log.exception("preparing the drain failed", extra={"region": self.region})
            if drain_listen_s > 0:
                # /health answers 503 from now on; new connections are still served (with
                # Connection: close) until the entry has taken this balancer out
                await asyncio.sleep(drain_listen_s)
            for site in list(self._runner.sites):
                await site.stop()  # the listening socket closes: new clients go elsewhere
            if self._peer_site is not None:
                await self._peer_site.stop()  # and peers forward elsewhere
            self._drained.clear()  # a request that ended during drain_listen_s set it
            deadline = loop_clock() + drain_timeout_s
            if self.fleet.has_siblings():
                await self._hand_off_units(deadline)
            if self.core.view.active_requests:
                # set by the last handler out
                await wait_event(self._drained, max(0.0, deadline - loop_clock()))
            log.info("drained", extra={"region": self.region, "left": self.core.view.active_requests})
        for svc in reversed(self.extra_services):
            with contextlib.suppress(Exception):
                await svc.stop()
        await cancel_tasks(self._tasks)
        self.counter.close()
        if self.kv_subscriber is not None:
            await self.kv_subscriber.stop()
        for runner in (self._peer_runner, self._runner):
            if runner is not None:
                await runner.cleanup()
        for s in (self._session, self._egress):
            if s is not None:
                await s.close()
        if self._upstream is not None:
            await self._upstream.close()
        if self.tracing is not None:
            await self.tracing.shutdown()  # the spans of the last requests are exported first

    async def _hand_off_units(self, deadline: float) -> None:
        """A member of a fleet leaving: once nothing of its own waits in its queue, its
        push-budget units go to its siblings (it stops holding and wanting them; a message
        says so at once); wait, until ``deadline``, for it to hold none (a unit still in use
        is given up when its push is seen, a unit it lent when the borrower gives it back
        or the lease ends) and for the message that says so to go out."""
        step = max(0.01, self.cfg.siblings.interval_s)
        handing_off = False
        while loop_clock() < deadline:
            if not handing_off and not self.core.view.queue_length:
                handing_off = self.fleet.start_draining()
                if not handing_off:
                    return
                log.info("handing push-budget units off", extra={"region": self.region,
                                                                 "units_held": self.fleet.units_held()})
                self.wake.set()  # a dispatch round, then the sibling channel looks at once
            for listener in self._dispatch_listeners:
                listener()
            if handing_off and not self.fleet.units_held():
                # the message that says so goes out before the channel closes
                await asyncio.sleep(min(2 * step, max(0.0, deadline - loop_clock())))
                break
            await asyncio.sleep(step)
        log.info("push-budget units handed off" if not self.fleet.units_held() else "units still held at the end",
                 extra={"region": self.region, "units_held": self.fleet.units_held(),
                        "requests_left": self.core.view.active_requests})

    # ------------------------------------------------------------------ probing

    async def _probe_loop(self) -> None:
        assert self._session is not None

        owners = self.probe_owners

        def targets() -> list[tuple[ReplicaInfo, str]]:
            # in a fleet each replica is probed by one member, its page shared with the
            # others (skymesh/routing/probe_owners.py); a region of one probes every replica
            owners.set_members(self.fleet.member_ids() if self.fleet.has_siblings() else ())
            owners.forget(self.replicas)
            return [(self.replicas[rid], self.replicas[rid].url)
                    for rid in owners.to_probe(self.replicas, loop_clock())]

        def apply(results: Sequence[tuple[ReplicaInfo, ProbeResult]]) -> None:
            share = self.fleet.has_siblings()
            applied = 0
            shared: list[SharedPage] = []
            for info, res in results:
                rid = info.replica_id
                if res.sent_at is None or owners.take_page(rid, res.sent_at):
                    self._apply_probe(info, res)
                    applied += 1
                if share:
                    shared.append((rid, res))
            self.metrics.replica_pages.labels("probed").inc(applied)
            if share:  # they go with the next sibling message
                self.sibling_link_port.share_pages(shared, len(self.replicas))
            self.wake.set()

        await probe_rounds(self._session, self.cfg.policy.probe_interval_s, targets, apply)

    def _apply_probe(self, info: ReplicaInfo, res: ProbeResult) -> None:
        if self.replicas.get(info.replica_id) is not info:
            return  # membership changed while probing
        info.note_probe(res)
        if res.healthy and info.max_model_len is None and self.cfg.upstream.max_model_len is None:
            self._learn_max_model_len(info)
        sample = (
            ProbeSample(num_running=res.num_running, num_waiting=res.num_waiting, kv_usage=res.kv_usage,
                        sent_at=res.sent_at)
            if res.healthy
            else None
        )
        self._apply(self.core.probe(info.replica_id, sample, loop_clock(), stalled=res.timed_out))

    def context_window(self) -> ContextWindow | None:
        """The model's context as requests are checked against it: ``upstream.max_model_len``,
        else the largest the region's replicas report (a request only the largest can take
        is still theirs to take); None until one is known."""
        limit = self.cfg.upstream.max_model_len or max(
            (info.max_model_len for info in self.replicas.values() if info.max_model_len is not None), default=None)
        return None if limit is None else ContextWindow(limit, self.max_chars_per_token)

    def _learn_max_model_len(self, info: ReplicaInfo) -> None:
        """Read a replica's max_model_len from its /v1/models, once it answers probes."""
        if self._session is None or info.replica_id in self._models_pending:
            return
        self._models_pending.add(info.replica_id)

        async def learn() -> None:
            try:
                assert self._session is not None
                limit = await fetch_max_model_len(self._session, info.url, self.cfg.model)
                if limit is not None and self.replicas.get(info.replica_id) is info:
                    info.max_model_len = limit
            finally:
                self._models_pending.discard(info.replica_id)

        self._tasks.append(asyncio.create_task(learn()))
        self._tasks = [t for t in self._tasks if not t.done()]

    def prefix_hit_ratio(self) -> float:
        return prefix_hit_ratio(self.replicas.values())

    # ------------------------------------------------------------------ dispatching

    async def _dispatch_loop(self) -> None:
        """One dispatch round on every wake-up (arrival, probe, completion) and at least
        every probe interval (queue-wait deadlines)."""
        loop = asyncio.get_running_loop()
        interval = self.cfg.policy.probe_interval_s
        while True:
            await wait_event(self.wake, interval)
            self.wake.clear()
            self._dispatch_once(loop.time())

    def _dispatch_once(self, now: float) -> None:
        t0 = time.perf_counter()
        actions = self.core.tick(now)
        placed = sum(isinstance(a, SendToReplica) for a in actions)
        if placed:
            self.metrics.decision_seconds.observe((time.perf_counter() - t0) / placed)
        self._apply(actions)
        for listener in self._dispatch_listeners:
            listener()

    def _apply(self, actions: list[Action]) -> None:
        """Carry out the core's actions (RequestFlow.apply: wake the waiting handlers)."""
        self.flow.apply(actions)

    # ------------------------------------------------------------------ status

    def admin_status(self) -> dict[str, Any]:
        return self.status_report().admin

    def status_report(self) -> StatusReport:
        """The /admin/status document, and the fields of it the controller report carries."""
        return build_status_report(
            now=asyncio.get_running_loop().time(), core=self.core, replicas=self.replicas,
            cache_source=self._cache_source,
            identity={"region": self.region, "balancer_id": self.balancer_id, "epoch": self.epoch,
                      "policy": self.policy_name},
            config={"sha256": self.config_sha256, "loaded_unix": round(self.config_loaded_unix, 3),
                    "last_reload": self.reload_status.as_json()},
            control={"controller_connected": self.controller_link_port.controller_connected,
                     "topology_version": self.controller_link_port.topology_version,
                     "siblings": {**self.fleet.status(), "channel": self.sibling_link_counts(),
                                  # the replicas this member probes for the fleet (probe_owners.py)
                                  "probes_owned": [rid for rid in self.replicas if self.probe_owners.owns(rid)]}},
            kv_events=self.kv_events_status(),
        )

    def _target(
        self, request: web.Request, req: RoutingRequest, action: SendToReplica | ForwardToRegion
    ) -> AttemptTarget | None:
        """Where an attempt for ``action`` goes (None: the replica left membership, or the
        peer has no peer listener)."""
        if isinstance(action, SendToReplica):
            info = self.replicas.get(action.replica_id)
            if info is None:
                return None
            assert self._session is not None
            return replica_target(info.url, request, self._session, region=self.region,
                                  replica_id=action.replica_id, request_id=req.request_id, pool=self._upstream)
        assert self._egress is not None
        peer_url = self.peers[action.region].peer_url
        if peer_url is None:  # no peer listener configured there (the config needs one to offload)
            return None
        return peer_target(
            peer_url, request, self._egress, region=self.region, peer_region=action.region,
            peer_token=self.peer_token, req=req,
            client_tls=None if self.peer_tls is None else self.peer_tls.client,
            server_hostname=None if self.peer_tls is None else balancer_server_name(action.region),
        )
