"""The central controller: membership, health, failover, DNS — off the data path.

It owns the topology from the YAML, probes every balancer's /health, declares one dead
after ``failure_threshold`` consecutive misses, lets the nearest live balancer adopt the
dead one's replicas (and hands them back on recovery), pushes every topology change to
the balancers' WatchTopology streams, keeps its state in SQLite (recovered on restart) and
tells the DNS provider which balancers are healthy. Balancers never wait on it.

This module is the shell: gRPC handlers, the HTTP app, the probe and DNS loops, SQLite
and the topology push. What the controller knows of each region is typed state
(controller/core/region_state.py) and every decision on it is the pure core's
(controller/core/): a balancer registers, reports, dies and is forgotten
(balancer_liveness.py: a balancer is alive while its ``/health`` answers or it keeps
calling Register/Report, dead after ``failure_threshold`` failed probes, when its siblings
take it out, or once it deregisters), a region is alive while any of its balancers is and
its replicas and DNS follow (failover.py), a replica's drain ends (drain.py). The shell
reads the clock and hands the core ``now``.
DNS is synced by its own task (on every change and every ``DNS_RESYNC_S``), so a slow or
dead DNS endpoint never delays failover or the topology push.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import aiohttp
import grpc
from aiohttp import web

from controller.balancer_members import MemberState
from controller.core import balancer_liveness, failover
from controller.core.drain import MemberLoad
from controller.core.recovery import recovered_region
from controller.core.region_state import Now, RegionState
from controller.entry_targets import EntryTargets
from controller.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from controller.metrics import ControllerMetrics
from controller.replica_sources import MembershipSources
from controller.state import StateStore
from controller.topology import nearest_alive
from skymesh.config import MeshConfig
from skymesh.dns.base import BalancerEndpoint, DnsProvider
from skymesh.edge.server import EdgeAppRunner, EdgeLimits
from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from skymesh.runtime.procs import cancel_tasks, wait_event
from skymesh.runtime.reload_plan import ReloadStatus
from skymesh.runtime.supervise import SupervisedLoop
from skymesh.security.admin_auth import admin_middleware, resolve_admin_token
from skymesh.security.pki import (
    ADMIN_IDENTITY,
    Credentials,
    balancer_identity,
    load_credentials,
    peer_identity,
    require_credentials_off_loopback,
)

log = logging.getLogger("skymesh.controller")

DNS_RESYNC_S = 5.0
SIBLINGS_TOOK_OUT = "its siblings report it unresponsive and its reports stopped"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _now() -> Now:
    """The instant the core's decisions are made at (the core reads no clock)."""
    return Now(wall_ms=_now_ms(), monotonic_s=time.monotonic())


class ControllerService(mesh_pb2_grpc.ControllerServicer):
    def __init__(self, cfg: MeshConfig, dns: DnsProvider | None = None, *, config_sha256: str | None = None) -> None:
        self.cfg = cfg
        self.dns = dns
        # the loaded config file: its SHA-256 (None: not from a file), when it was loaded,
        # and the last SIGHUP reload (controller/reload_rules.py)
        self.config_sha256 = config_sha256
        self.config_loaded_unix = time.time()
        self.reload_status = ReloadStatus()
        self.admin_token = resolve_admin_token(cfg)
        # mesh identity: mTLS credentials (None: loopback-only, no TLS; refused off loopback)
        self.creds: Credentials | None = load_credentials(cfg, "controller")
        require_credentials_off_loopback(cfg.controller.listen.host, self.creds, "the controller")
        self.store = StateStore(cfg.controller.state_path)
        stored = self.store.load()
        self.version: int = stored.version
        self.started_ms = _now_ms()
        self.metrics = ControllerMetrics()
        # what the controller knows of each region (controller/core/region_state.py): its
        # record as one endpoint (alive: any of its balancers), its balancers, their reports
        now = _now()
        presumed_until = failover.presumed_alive_until(cfg, now)
        self.regions: dict[str, RegionState] = {}
        for r in cfg.regions:
            state = recovered_region(r, stored.regions.get(r.name), stored.members.get(r.name, {}), presumed_until)
            if r.name in stored.reports:
                state.last_admin = stored.reports[r.name]
            if r.name in stored.report_protos:
                state.last_report = mesh_pb2.BalancerReport.FromString(stored.report_protos[r.name])
            self.regions[r.name] = state
            self._refresh_region(state, now)
        self.owners = failover.recovered_owners(cfg, stored.owners, self.regions)
        # one slot per watcher: only the newest topology matters (balancers skip older)
        self._subscribers: set[asyncio.Queue[Any]] = set()
        self._dns_dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._grpc: grpc.aio.Server | None = None
        self._runner: EdgeAppRunner | None = None
        # name ("grpc", "http") -> port bound by start()
        self.bound_ports: dict[str, int] = {}
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        # replicas that join and leave besides the YAML ones (registration API, AWS)
        self.membership = MembershipSources(self, self.metrics.registry)
        for r in cfg.regions:
            self.metrics.region_known(r.name)
        # the regions' entry target groups on AWS follow their members (None: none named)
        self.entry: EntryTargets | None = None
        if EntryTargets.configured(cfg.regions):
            self.entry = EntryTargets(cfg.regions, self.metrics.registry)

    # ------------------------------------------------------------------ regions

    def _refresh_region(self, state: RegionState, now: Now) -> bool:
        """The region's record from its members (controller.core.failover.refresh_region),
        and its member gauges; True when the region's liveness changed."""
        changed = failover.refresh_region(state, now)
        self._region_gauges(state)
        return changed

    def _region_gauges(self, state: RegionState) -> None:
        self.metrics.balancers.labels(state.name).set(len(state.members))
        self.metrics.balancers_alive.labels(state.name).set(sum(m.alive for m in state.members))

    def _add_members(self, out: Any, region: str) -> None:
        """The region's balancers into a repeated BalancerMember field."""
        for m in self.regions[region].members:
            out.add(balancer_id=m.name, alive=m.alive, epoch=m.epoch, http_url=m.http_url,
                    grpc_address=m.published_grpc_address, last_seen_unix_ms=m.last_seen_ms or 0,
                    instance_epoch=m.instance_epoch)

    def live_member_loads(self, region: str) -> list[MemberLoad | None]:
        """The load each live member of ``region`` last reported, None for one that has not
        reported since it registered: a replica's drain ends only when every one of them
        says it is idle (controller/core/drain.py)."""
        state = self.regions.get(region)
        return state.live_loads() if state is not None else []

    # ------------------------------------------------------------------ topology

    def alive_regions(self) -> set[str]:
        return failover.alive_regions(self.regions)

    def home_of(self) -> dict[str, tuple[str, str]]:
        return {rep.id: (r.name, rep.url) for r in self.cfg.regions for rep in r.replicas}

    def replica_roles(self) -> dict[str, str]:
        """replica id -> its prefill/decode role: as the latest report of the region that
        owns it says (an empty role, from a balancer before roles: ``both``), else as the
        config or its membership source gives it."""
        roles = {rep.id: str(rep.role) for r in self.cfg.regions for rep in r.replicas}
        roles.update(self.membership.roles())
        for state in self.regions.values():
            if state.last_report is not None:
                roles.update({x.replica_id: x.role or "both" for x in state.last_report.replicas})
        return roles

    def topology(self) -> Any:
        homes = self.home_of()
        out = mesh_pb2.Topology(version=self.version, policy=self.cfg.policy.name)
        listed_roles = {rep.id: rep.role for r in self.cfg.regions for rep in r.replicas}
        for r in self.cfg.regions:
            b = self.regions[r.name].record
            a = out.balancers.add(
                region=r.name, balancer_id=b.balancer_id, http_url=b.http_url,
                grpc_address=b.grpc_address, alive=b.alive,
            )
            self._add_members(a.members, r.name)
            for rid, owner in sorted(self.owners.items()):
                if owner == r.name:
                    home, url = homes[rid]
                    a.replicas.add(replica_id=rid, url=url, home_region=home, role=listed_roles.get(rid, "both"))
        self.membership.assign(out)
        return out

    async def _changed(self, reason: str) -> None:
        """Recompute ownership after a liveness change; persist, push, update DNS."""
        async with self._lock:
            self.owners = failover.owners(self.cfg, self.regions)
            self.version += 1
            homes = self.home_of()
            owners = {rid: (o, homes[rid][0], homes[rid][1]) for rid, o in self.owners.items()}
            # copies: the event loop goes on changing the records while the thread saves
            records = {name: replace(st.record) for name, st in self.regions.items()}
            members = {name: [replace(m) for m in st.members] for name, st in self.regions.items()}
            await asyncio.to_thread(self.store.save_topology, self.version, owners, records, members)
            topo = self.topology()
            for q in list(self._subscribers):
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(topo)
            log.info("topology changed", extra={"version": self.version, "reason": reason,
                                                 "alive": sorted(self.alive_regions())})
        self._dns_dirty.set()

    async def apply_config(self, cfg: MeshConfig, admin_token: str | None, *, config_sha256: str | None,
                           push: bool = True) -> None:
        """Take a reloaded config whose changes are all live ones (controller/reload_rules.py
        checks that first): membership (each region's replicas), the DNS settings the
        controller applies (public IPs, AWS regions, the Route53 TTL), probe settings,
        latencies (who adopts whom) and the admin token. With ``push``, the topology
        version goes up, the new topology is pushed to every watcher and DNS is synced."""
        # config and ownership change together: topology() must never see a replica
        # that one of them lacks
        self.membership.config_changed(self.cfg, cfg)
        self.cfg = cfg
        self.owners = failover.owners(cfg, self.regions)
        self.admin_token = admin_token
        self.config_sha256 = config_sha256
        self.config_loaded_unix = time.time()
        if cfg.dns.provider == "route53":
            # lazy: boto3 only when dns.provider is route53
            from skymesh.dns.route53 import Route53Provider

            if isinstance(self.dns, Route53Provider):
                self.dns.ttl = cfg.dns.ttl_s
        if push:
            await self._changed("config reloaded")

    def endpoints(self) -> list[BalancerEndpoint]:
        return failover.endpoints(self.cfg, self.regions)

    async def sync_dns(self) -> bool:
        """Push the current endpoint health to the DNS provider; False when that failed."""
        if self.dns is None:
            return True
        try:
            changed = await self.dns.sync(self.endpoints())
        except Exception as e:  # DNS trouble must never stop failover handling
            log.warning("dns sync failed", extra={"provider": self.dns.name, "error": repr(e)})
            return False
        if changed:
            log.info("dns updated", extra={"provider": self.dns.name,
                                           "healthy": sorted(self.alive_regions())})
        return True

    async def _dns_loop(self) -> None:
        """Sync on every change (coalesced) and every DNS_RESYNC_S (repairs drift, e.g.
        a restarted DNS server that came back with every balancer marked healthy)."""
        while True:
            # not asyncio.wait_for: on Python 3.11 it can swallow a cancellation arriving as
            # the event fires, and stop() then waits for this loop forever (procs.wait_event)
            await wait_event(self._dns_dirty, DNS_RESYNC_S)
            self._dns_dirty.clear()
            if not await self.sync_dns():
                await asyncio.sleep(min(1.0, DNS_RESYNC_S))
                self._dns_dirty.set()  # retry soon: a failover must reach DNS

    # ------------------------------------------------------------------ health

    async def _set_alive(self, region: str, alive: bool, reason: str, member: MemberState) -> None:
        """One balancer of ``region`` is alive (seen now) or dead
        (controller.core.balancer_liveness.mark); a change is pushed, and the region's
        entry told."""
        state = self.regions[region]
        change = balancer_liveness.mark(state, member, alive, _now())
        if change is None:
            return
        self._region_gauges(state)
        if self.entry is not None and (change.member_changed or member.draining):
            self.entry.poke()
        if change.member_changed:
            await self._changed(failover.member_change_reason(region, member, alive, reason, change.region_changed))

    async def _probe(self, region: str, member: MemberState,
                     limit: aiohttp.ClientTimeout) -> tuple[str, MemberState, bool, str]:
        """(region, member, it answered /health with 200 or, when it cannot be probed,
        reported lately, why not)."""
        assert self._session is not None
        if not member.probe_url:
            return (region, member, *balancer_liveness.unprobed_answer(member, _now()))
        try:
            async with self._session.get(member.probe_url + "/health", timeout=limit) as r:
                return region, member, r.status == 200, f"HTTP {r.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return region, member, False, type(e).__name__

    async def _probe_loop(self) -> None:
        assert self._session is not None
        while True:
            started = time.monotonic()
            interval = self.cfg.controller.probe_interval_s  # read each round: a reload may change it
            limit = aiohttp.ClientTimeout(total=max(0.5, min(2.0, interval)))

            # a failed round (e.g. the state disk is full) raises to the supervisor, which
            # logs it (rate-limited), counts it and probes again after a short backoff
            probes = [self._probe(name, m, limit) for name, state in self.regions.items() for m in state.members]
            for region, member, ok, why in await asyncio.gather(*probes):
                verdict = balancer_liveness.after_probe(member, ok, self.cfg.controller.failure_threshold)
                if verdict.alive:
                    await self._set_alive(region, True, "probe ok", member)
                elif verdict.dead:
                    if verdict.taken_out:
                        self.metrics.members_taken_out.labels(region, "probes").inc()
                    await self._set_alive(region, False, why, member)
            for region in list(self.regions):
                await self._watch_siblings(region)
            await self._forget_and_presume()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _watch_siblings(self, region: str) -> None:
        """Take out the members of ``region`` their siblings' reports say are gone
        (controller/sibling_watch.py); one comes back as ever, by a report or good probe."""
        for m in balancer_liveness.taken_out_by_siblings(self.regions[region], self.started_ms, _now()):
            self.metrics.members_taken_out.labels(region, "siblings").inc()
            log.warning("balancer taken out by its siblings", extra={"region": region, "balancer_id": m.name})
            await self._set_alive(region, False, SIBLINGS_TOOK_OUT, m)

    async def _forget_and_presume(self) -> None:
        """Members the config does not list, dead and silent past
        balancer_liveness.FORGET_UNLISTED_AFTER_S, are dropped; a registered fleet none of
        whose balancers is known stops being presumed alive once its first balancers had
        time to register."""
        for region, state in self.regions.items():
            now = _now()
            for m in balancer_liveness.forget_departed(state, now):
                await asyncio.to_thread(self.store.forget_member, region, m.key)
                log.info("forgot a departed balancer", extra={"region": region, "balancer_id": m.name})
            if self._refresh_region(state, now):
                await self._changed(failover.emptied_reason(state))

    # ------------------------------------------------------------------ gRPC

    async def _authorize_region(self, region: str, context: Any) -> None:
        """A balancer may only speak for the region its certificate names (mesh identity);
        without TLS (loopback-only local mode) every caller is trusted."""
        if self.creds is None:
            return
        identity = peer_identity(context)
        if identity != balancer_identity(region):
            log.warning("rejected a call for another region's balancer",
                        extra={"region": region, "identity": identity or "none"})
            self.metrics.rejected_calls.labels("wrong_identity").inc()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"identity {identity or 'none'} may not act for region {region!r}")

    async def Register(self, request: Any, context: Any) -> Any:  # noqa: N802
        if request.region not in self.regions:
            return mesh_pb2.RegisterReply(accepted=False, reason=f"unknown region {request.region!r}")
        if len(request.balancer_id) > 128:
            return mesh_pb2.RegisterReply(accepted=False, reason="balancer id longer than 128 characters")
        await self._authorize_region(request.region, context)
        region_cfg = self.cfg.region(request.region)
        # the addresses DNS and peers get come from the config, never from the caller
        for field, configured in (("http_url", region_cfg.balancer.advertise_url),
                                  ("grpc_address", str(region_cfg.balancer.grpc_advertise))):
            claimed = getattr(request, field)
            if claimed and claimed != configured:
                self.metrics.rejected_calls.labels("wrong_address").inc()
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{field} {claimed!r} is not the configured {configured!r} of {request.region}")
        if region_cfg.balancer.fleet == "registered" and not request.balancer_id:
            self.metrics.rejected_calls.labels("no_balancer_id").inc()
            return mesh_pb2.RegisterReply(accepted=False, reason=f"{request.region} is a registered fleet: a balancer "
                                                                 "registers under its own id")
        state = self.regions[request.region]
        # its own addresses, as it says (the sibling channel and the controller's calls
        # authenticate themselves); the controller issues the epoch, the caller's own
        # request.epoch only names its sibling messages
        admitted = balancer_liveness.admit_registration(state, request.balancer_id, int(request.epoch),
                                                        request.member_grpc_address, request.member_http_url,
                                                        _now())
        if admitted.displaced is not None:
            # two live balancers of one config fold onto its one member: say how to fix it
            log.warning("another balancer took the region's only listed member while the last one still reported;"
                        " an Auto Scaling group needs balancer.fleet: registered",
                        extra={"region": request.region, "previous": admitted.displaced,
                               "balancer_id": request.balancer_id})
        member, epoch = admitted.member, admitted.epoch
        # persisted before it is handed out: an epoch never repeats, even across a restart
        await asyncio.to_thread(self.store.save_member_epoch, request.region, member.key, member.balancer_id, epoch)
        was_alive = balancer_liveness.registered(state, member)
        await self._set_alive(request.region, True, f"registered (epoch {epoch})", member)
        if admitted.changed and was_alive:
            # a restarted balancer (new id): persist and push
            await self._changed(f"{request.region} registered {member.name} epoch {epoch}")
        log.info("balancer registered", extra={"region": request.region, "balancer_id": request.balancer_id,
                                               "member": member.key, "epoch": epoch,
                                               "version_reported": request.version})
        return mesh_pb2.RegisterReply(accepted=True, topology=self.topology(), epoch=epoch)

    async def Report(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self.regions.get(request.region)
        if state is None:
            return mesh_pb2.ReportReply(topology_version=self.version)
        await self._authorize_region(request.region, context)
        member = balancer_liveness.reporting_member(state, request.balancer_id, request.epoch)
        if member is None:
            return mesh_pb2.ReportReply(topology_version=self.version)
        admin = balancer_liveness.admin_of(request.admin_json)
        now = _now()
        balancer_liveness.take_report(state, member, request, admin, now)
        await self._set_alive(request.region, True, "report", member)
        await self._watch_siblings(request.region)
        await asyncio.to_thread(self.store.save_report, request.region, admin, _now_ms(),
                                request.SerializeToString())
        return mesh_pb2.ReportReply(topology_version=self.version)

    async def Deregister(self, request: Any, context: Any) -> Any:  # noqa: N802
        state = self.regions.get(request.region)
        if state is None:
            return mesh_pb2.DeregisterReply(accepted=False, reason=f"unknown region {request.region!r}",
                                            topology_version=self.version)
        await self._authorize_region(request.region, context)
        member = balancer_liveness.deregistering_member(state, request.balancer_id, request.epoch)
        if member is None:
            self.metrics.rejected_calls.labels("stale_deregister").inc()
            return mesh_pb2.DeregisterReply(
                accepted=False, topology_version=self.version,
                reason=f"not the current registration of {request.region} (epoch {state.record.epoch})")
        balancer_liveness.start_drain(member)
        reason = request.reason[:200] or "deregistered"
        # the region stays alive (DNS unchanged) while another of its balancers is
        await self._set_alive(request.region, False, f"deregistered: {reason}", member)
        log.info("balancer deregistered", extra={"region": request.region, "balancer_id": request.balancer_id,
                                                 "epoch": request.epoch, "reason": reason})
        return mesh_pb2.DeregisterReply(accepted=True, topology_version=self.version)

    async def WatchTopology(self, request: Any, context: Any) -> Any:  # noqa: N802
        # a balancer watches as its own region; an admin (status tool) may watch too
        if self.creds is not None and peer_identity(context) != ADMIN_IDENTITY:
            await self._authorize_region(request.region, context)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._subscribers.add(q)
        try:
            topo = self.topology()
            last = topo.version
            yield topo
            while True:
                topo = await q.get()
                # a change in flight while this stream opened may already be in the first
                # topology: every stream sees strictly increasing versions
                if topo.version > last:
                    last = topo.version
                    yield topo
        finally:
            self._subscribers.discard(q)

    async def GetStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        st = mesh_pb2.MeshStatus(
            topology=self.topology(), controller_started_unix_ms=self.started_ms, state_version=self.version
        )
        for r in self.cfg.regions:
            state = self.regions[r.name]
            b = state.record
            rs = st.regions.add(region=r.name, balancer_alive=b.alive, balancer_id=b.balancer_id,
                                last_seen_unix_ms=b.last_seen_ms or 0)
            self._add_members(rs.members, r.name)
            if state.last_report is not None:
                rs.last_report.CopyFrom(state.last_report)
        return st

    # ------------------------------------------------------------------ HTTP (status)

    def status_json(self) -> dict[str, Any]:
        homes = self.home_of()
        roles = self.replica_roles()
        regions = []
        for r in self.cfg.regions:
            state = self.regions[r.name]
            b = state.record
            regions.append({
                "region": r.name,
                "balancer_alive": b.alive,
                # deregistered (SIGTERM drain): out until it registers again
                "balancer_draining": b.draining,
                "balancer_id": b.balancer_id,
                "balancer_epoch": b.epoch,
                "balancer_url": b.http_url,
                "balancer_grpc": b.grpc_address,
                "last_seen_unix_ms": b.last_seen_ms,
                # the region's balancers (a fleet behind its entry); alive: any of them
                "balancers": [m.as_json() for m in state.members],
                "owned_replicas": [
                    {"replica_id": rid, "url": homes[rid][1], "home_region": homes[rid][0], "role": roles[rid]}
                    for rid, o in sorted(self.owners.items()) if o == r.name
                ],
                "nearest_alive": nearest_alive(self.cfg, r.name, self.alive_regions()),
                "report": state.last_admin if b.alive else None,
            })
        return {
            "source": "controller",
            "controller": {
                "started_unix_ms": self.started_ms, "topology_version": self.version,
                "config": {"sha256": self.config_sha256, "loaded_unix": round(self.config_loaded_unix, 3),
                           "last_reload": self.reload_status.as_json()},
            },
            "policy": self.cfg.policy.name,
            "regions": regions,
            # the replicas of the registration API and AWS, and YAML ones draining after a reload
            "membership": self.membership.status_json(),
        }

    def make_app(self) -> web.Application:
        # the status/topology API and /metrics need the admin token (/health stays open)
        app = web.Application(middlewares=[admin_middleware(lambda: self.admin_token, ("/v1/",), lambda: self.cfg)])

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def status(_: web.Request) -> web.Response:
            return web.json_response(self.status_json())

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

        async def topology(_: web.Request) -> web.Response:
            t = self.topology()
            roles = self.replica_roles()
            return web.json_response({
                "version": t.version, "policy": t.policy,
                "balancers": [{
                    "region": a.region, "balancer_id": a.balancer_id, "http_url": a.http_url,
                    "grpc_address": a.grpc_address, "alive": a.alive,
                    "members": [{"balancer_id": m.balancer_id, "alive": m.alive, "epoch": m.epoch,
                                 "http_url": m.http_url, "grpc_address": m.grpc_address,
                                 "last_seen_unix_ms": m.last_seen_unix_ms} for m in a.members],
                    "replicas": [{"replica_id": x.replica_id, "url": x.url, "home_region": x.home_region,
                                  "draining": x.draining, "role": roles.get(x.replica_id, "both")}
                                 for x in a.replicas],
                } for a in t.balancers],
            })

        app.router.add_get("/health", health)
        app.router.add_get("/v1/status", status)
        app.router.add_get("/v1/topology", topology)
        app.router.add_get("/metrics", metrics)
        self.membership.add_routes(app)
        return app

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        self._grpc = grpc.aio.server()
        mesh_pb2_grpc.add_ControllerServicer_to_server(self, self._grpc)
        g = self.cfg.controller.listen
        # the ports actually bound (the config's, or the kernel's pick for port 0)
        if self.creds is not None:
            self.bound_ports["grpc"] = self._grpc.add_secure_port(f"{g.host}:{g.port}",
                                                                  self.creds.server_credentials())
        else:
            self.bound_ports["grpc"] = self._grpc.add_insecure_port(f"{g.host}:{g.port}")
        await self._grpc.start()
        # bounded heads, connections and idle time; no body is decoded (skymesh/edge/server.py)
        self._runner = EdgeAppRunner(self.make_app(), metrics=self.metrics.edge,
                                     limits=EdgeLimits.from_config(self.cfg))
        await self._runner.setup()
        h = self.cfg.controller.http_listen
        await web.TCPSite(self._runner, h.host, h.port, reuse_address=True).start()
        self.bound_ports["http"] = int(self._runner.addresses[0][1])
        interval = self.cfg.controller.probe_interval_s
        loops = [("probe", self._probe_loop, interval), ("dns-sync", self._dns_loop, min(1.0, DNS_RESYNC_S)),
                 *self.membership.loops()]
        if self.entry is not None:
            entry = self.entry
            loops.append(("entry-targets",
                          lambda: entry.run({name: st.members for name, st in self.regions.items()},
                                            lambda: self.cfg.controller.probe_interval_s),
                          interval))
        for name, body, backoff_s in loops:
            self._tasks.append(SupervisedLoop(
                name, body, on_restart=self.metrics.loop_restarted, logger=log,
                backoff_s=backoff_s, max_backoff_s=max(backoff_s, 5.0)).start())
        # a (re)start is a new topology version: monotonic across restarts, persisted
        await self._changed("controller started")
        log.info("controller started", extra={"version": self.version, "grpc": str(g), "http": str(h)})

    async def stop(self) -> None:
        await cancel_tasks(self._tasks)
        if self._grpc is not None:
            await self._grpc.stop(grace=0.5)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self.dns is not None:
            await self.dns.close()
        self.store.close()
        self.membership.close()
