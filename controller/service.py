"""The central controller: membership, health, failover, DNS — off the data path.

It owns the topology from the YAML, probes every balancer's /health, declares one dead
after ``failure_threshold`` consecutive misses, lets the nearest live balancer adopt the
dead one's replicas (and hands them back on recovery), pushes every topology change to
the balancers' WatchTopology streams, keeps its state in SQLite (recovered on restart) and
tells the DNS provider which balancers are healthy. Balancers never wait on it.

Liveness: a region is a fleet of balancers (controller/balancer_members.py), each with its
own registration and epoch. A balancer is alive while its HTTP ``/health`` answers the
controller's probe or it keeps calling Register/Report (either resets its failure count);
it is dead after ``failure_threshold`` consecutive failed probes with no Register/Report in
between, or once it deregisters. A region is alive while any of its balancers is: failover
and DNS change only when the last one dies or leaves.
DNS is synced by its own task (on every change and every ``DNS_RESYNC_S``), so a slow or
dead DNS endpoint never delays failover or the topology push.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aiohttp
import grpc
from aiohttp import web

from controller.balancer_members import (
    UNPROBED_REPORT_STALE_S,
    MemberState,
    configured_members,
    dialable,
    member_of_registration,
    registered_member,
)
from controller.entry_targets import EntryTargets
from controller.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from controller.metrics import ControllerMetrics
from controller.replica_sources import MembershipSources
from controller.sibling_watch import WatchedMember, bounded_names, taken_out
from controller.state import StateStore
from controller.topology import assign_owners, nearest_alive
from skymesh.config import MeshConfig, RegionConfig
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
# a member the config does not list, dead and silent this long, is forgotten (an Auto
# Scaling group replaces instances: their records must not pile up)
FORGET_UNLISTED_AFTER_S = 900.0


@dataclass(slots=True)
class MemberReport:
    """One balancer's latest report: its admin JSON (an untrusted shape), the report as
    sent, and when it came."""

    admin: dict[str, Any]
    proto: Any  # mesh_pb2.BalancerReport
    at_ms: int


def _now_ms() -> int:
    return int(time.time() * 1000)


def _dialable_url(url: str) -> bool:
    """An http(s) URL whose host is neither empty nor a wildcard."""
    try:
        u = urlparse(url)
        port = u.port
    except ValueError:
        return False
    return u.scheme in ("http", "https") and bool(u.hostname) and port is not None \
        and dialable(f"{u.hostname}:{port}")


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
        st = self.store.load()
        self.version: int = st["version"]
        self.started_ms = _now_ms()
        self.metrics = ControllerMetrics()
        # each region as one endpoint (alive: any of its balancers), derived from its
        # members by _refresh_region; the region's latest registration names it
        self.balancers: dict[str, dict[str, Any]] = {}
        self.members: dict[str, list[MemberState]] = {}
        self._latest_member: dict[str, str] = {}
        for r in cfg.regions:
            saved = st["balancers"].get(r.name, {})
            self.members[r.name] = self._recovered_members(r, saved, st["members"].get(r.name, {}))
            self.balancers[r.name] = {
                "balancer_id": saved.get("balancer_id") or "",
                "epoch": saved.get("epoch") or 0,
                "alive": True,
                "http_url": r.balancer.advertise_url,
                "grpc_address": str(r.balancer.grpc_advertise),
                "last_seen_ms": saved.get("last_seen_ms"),
            }
            latest = max(self.members[r.name], key=lambda m: m.epoch, default=None)
            if latest is not None and latest.epoch:
                self._latest_member[r.name] = latest.key
        # a registered fleet with no member known yet (a first start) is presumed alive for
        # as long as a listed balancer would be: until its first balancers had time to
        # register (probe rounds to the failure threshold, plus a report's staleness)
        self._presumed_until = time.monotonic() + (cfg.controller.failure_threshold * cfg.controller.probe_interval_s
                                                   + UNPROBED_REPORT_STALE_S)
        for r in cfg.regions:
            self._refresh_region(r.name)
        # the region's latest report (its view for status), and every member's own
        self.reports: dict[str, dict[str, Any]] = st["reports"]
        self.member_reports: dict[str, dict[str, MemberReport]] = {r.name: {} for r in cfg.regions}
        self.last_reports: dict[str, Any] = {}
        for region, blob in st["report_protos"].items():
            self.last_reports[region] = mesh_pb2.BalancerReport.FromString(blob)
        saved_owners = st["owners"]
        known = {rep.id for r in cfg.regions for rep in r.replicas}
        if saved_owners and set(saved_owners) == known:
            self.owners = saved_owners  # recovered ownership (e.g. an adoption in force)
        else:
            self.owners = assign_owners(cfg, self.alive_regions())
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

    # ------------------------------------------------------------------ members

    @staticmethod
    def _recovered_members(region: RegionConfig, saved_region: dict[str, Any],
                           saved: dict[str, dict[str, Any]]) -> list[MemberState]:
        """The region's configured members plus those that registered without being in the
        config, with what the state file kept of each (epochs never repeat)."""
        members = configured_members(region)
        known = {m.key for m in members}
        for key, rec in saved.items():
            if key not in known:
                members.append(MemberState(key=key, configured=False, http_url=rec.get("http_url") or "",
                                           grpc_address=rec.get("grpc_address") or "", probe_url=""))
        for m in members:
            rec = saved.get(m.key)
            if rec is not None:
                m.balancer_id = rec.get("balancer_id") or ""
                m.epoch = rec.get("epoch") or 0
                m.instance_epoch = rec.get("instance_epoch") or 0
                # a balancer not known to be dead is presumed alive until probes say so
                m.alive = bool(rec.get("alive", True))
                m.draining = bool(rec.get("draining"))
                m.last_seen_ms = rec.get("last_seen_ms")
        if len(members) == 1 and members[0].configured and not saved:
            # a state file from before fleets: the region's record was its one balancer's
            m = members[0]
            m.balancer_id = saved_region.get("balancer_id") or ""
            m.epoch = saved_region.get("epoch") or 0
            m.alive = bool(saved_region.get("alive", True))
            m.last_seen_ms = saved_region.get("last_seen_ms")
        return members

    def _refresh_region(self, region: str) -> None:
        """The region's record from its members: alive while any is, draining when all
        are, named by its latest registration."""
        b = self.balancers[region]
        members = self.members[region]
        if members:
            b["alive"] = any(m.alive for m in members)
            b["draining"] = all(m.draining for m in members)
        else:  # a registered fleet none of whose balancers registered yet
            b["alive"] = time.monotonic() < self._presumed_until
            b["draining"] = False
        latest = next((m for m in members if m.key == self._latest_member.get(region)), None)
        if latest is not None:
            b["balancer_id"], b["epoch"] = latest.balancer_id, latest.epoch
        seen = [m.last_seen_ms for m in members if m.last_seen_ms is not None]
        b["last_seen_ms"] = max(seen) if seen else b.get("last_seen_ms")
        self.metrics.balancers.labels(region).set(len(members))
        self.metrics.balancers_alive.labels(region).set(sum(m.alive for m in members))

    def _members_json(self) -> dict[str, list[dict[str, Any]]]:
        return {region: [m.as_json() for m in members] for region, members in self.members.items()}

    def _add_members(self, out: Any, region: str) -> None:
        """The region's balancers into a repeated BalancerMember field."""
        for m in self.members[region]:
            out.add(balancer_id=m.name, alive=m.alive, epoch=m.epoch, http_url=m.http_url,
                    grpc_address=m.published_grpc_address, last_seen_unix_ms=m.last_seen_ms or 0,
                    instance_epoch=m.instance_epoch)

    def live_member_reports(self, region: str) -> list[Any]:
        """The latest report of each live member of ``region`` (admin JSON), None for a live
        member that has not reported since it registered: a replica's drain ends only when
        every one of them says it is idle (controller/membership.py)."""
        got = self.member_reports.get(region, {})
        return [got[m.key].admin if m.key in got else None
                for m in self.members.get(region, []) if m.alive and not m.draining]

    # ------------------------------------------------------------------ topology

    def alive_regions(self) -> set[str]:
        return {r for r, b in self.balancers.items() if b["alive"]}

    def home_of(self) -> dict[str, tuple[str, str]]:
        return {rep.id: (r.name, rep.url) for r in self.cfg.regions for rep in r.replicas}

    def replica_roles(self) -> dict[str, str]:
        """replica id -> its prefill/decode role: as the latest report of the region that
        owns it says (an empty role, from a balancer before roles: ``both``), else as the
        config gives it."""
        roles = {rep.id: str(rep.role) for r in self.cfg.regions for rep in r.replicas}
        for report in self.last_reports.values():
            roles.update({x.replica_id: x.role or "both" for x in report.replicas})
        return roles

    def topology(self) -> Any:
        homes = self.home_of()
        out = mesh_pb2.Topology(version=self.version, policy=self.cfg.policy.name)
        for r in self.cfg.regions:
            b = self.balancers[r.name]
            a = out.balancers.add(
                region=r.name, balancer_id=b["balancer_id"], http_url=b["http_url"],
                grpc_address=b["grpc_address"], alive=b["alive"],
            )
            self._add_members(a.members, r.name)
            for rid, owner in sorted(self.owners.items()):
                if owner == r.name:
                    home, url = homes[rid]
                    a.replicas.add(replica_id=rid, url=url, home_region=home)
        self.membership.assign(out)
        return out

    async def _changed(self, reason: str) -> None:
        """Recompute ownership after a liveness change; persist, push, update DNS."""
        async with self._lock:
            self.owners = assign_owners(self.cfg, self.alive_regions())
            self.version += 1
            homes = self.home_of()
            owners = {rid: (o, homes[rid][0], homes[rid][1]) for rid, o in self.owners.items()}
            await asyncio.to_thread(self.store.save_topology, self.version, owners, self.balancers,
                                    self._members_json())
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
        self.owners = assign_owners(cfg, self.alive_regions())
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
        eps = []
        for r in self.cfg.regions:
            b = self.balancers[r.name]
            u = urlparse(b["http_url"])
            eps.append(BalancerEndpoint(
                region=r.name, balancer_id=b["balancer_id"] or r.name,
                ip=r.balancer.public_ip or u.hostname or "",
                port=u.port or 80, healthy=b["alive"], aws_region=r.aws_region,
            ))
        return eps

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
        """One balancer of ``region`` is alive (seen now) or dead; the region follows its
        members: it dies with the last and recovers with the first."""
        if alive and member.draining:
            # a deregistered balancer still answers while it drains: only a new
            # registration brings it back
            return
        if alive:
            member.failures = 0
            member.last_seen_ms = _now_ms()
        region_was_alive = self.balancers[region]["alive"]
        member_changed = member.alive != alive
        member.alive = alive
        self._refresh_region(region)
        if self.entry is not None and (member_changed or member.draining):
            self.entry.poke()
        if not member_changed:
            return
        if self.balancers[region]["alive"] != region_was_alive:
            await self._changed(f"{region} {'recovered' if alive else 'dead'}: {reason}")
        else:
            # the region's own state is unchanged (DNS and ownership too); its balancers
            # learn who their siblings are from the pushed topology
            await self._changed(f"{region} balancer {member.name} {'recovered' if alive else 'dead'}: {reason}")

    async def _probe(self, region: str, member: MemberState,
                     limit: aiohttp.ClientTimeout) -> tuple[str, MemberState, bool, str]:
        """(region, member, it answered /health with 200 or, when it cannot be probed,
        reported lately, why not)."""
        assert self._session is not None
        if not member.probe_url:
            quiet_s = (_now_ms() - (member.last_seen_ms or 0)) / 1000
            return region, member, quiet_s <= UNPROBED_REPORT_STALE_S, f"no report for {quiet_s:.0f}s"
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
            probes = [self._probe(region, m, limit) for region, members in self.members.items() for m in members]
            for region, member, ok, why in await asyncio.gather(*probes):
                if ok and member.probe_url:
                    await self._set_alive(region, True, "probe ok", member)
                elif ok:
                    member.failures = 0  # it reported lately; only its calls say it was seen
                else:
                    member.failures += 1
                    if member.failures >= self.cfg.controller.failure_threshold:
                        if member.alive and not member.draining:
                            self.metrics.members_taken_out.labels(region, "probes").inc()
                        await self._set_alive(region, False, why, member)
            for region in list(self.members):
                await self._watch_siblings(region)
            await self._forget_and_presume()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def _watched(self, region: str) -> list[WatchedMember]:
        """The region's members as the sibling watch reads them: heard from at their latest
        report, registration or good probe, and never before this controller started (no
        report could reach it earlier); each report's names bounded."""
        reports = self.member_reports.get(region, {})
        out = []
        for m in self.members[region]:
            rep = reports.get(m.key)
            heard = max(t for t in (rep.at_ms if rep else None, m.last_seen_ms, self.started_ms) if t is not None)
            out.append(WatchedMember(
                key=m.key, balancer_id=m.balancer_id, alive=m.alive, draining=m.draining, heard_at_ms=heard,
                named_unresponsive=bounded_names(rep.proto.unresponsive_siblings) if rep else frozenset(),
                report_at_ms=rep.at_ms if rep else None))
        return out

    async def _watch_siblings(self, region: str) -> None:
        """Take out the members of ``region`` their siblings' reports say are gone
        (controller/sibling_watch.py); one comes back as ever, by a report or good probe."""
        gone = set(taken_out(self._watched(region), _now_ms()))
        for m in [m for m in self.members[region] if m.key in gone and m.alive]:
            self.metrics.members_taken_out.labels(region, "siblings").inc()
            log.warning("balancer taken out by its siblings", extra={"region": region, "balancer_id": m.name})
            await self._set_alive(region, False, SIBLINGS_TOOK_OUT, m)

    async def _forget_and_presume(self) -> None:
        """Members the config does not list, dead and silent past FORGET_UNLISTED_AFTER_S,
        are dropped; a registered fleet none of whose balancers is known stops being
        presumed alive once its first balancers had time to register."""
        now = _now_ms()
        for region, members in self.members.items():
            gone = [m for m in members if not m.configured and not m.alive
                    and now - (m.last_seen_ms or 0) > FORGET_UNLISTED_AFTER_S * 1000]
            for m in gone:
                members.remove(m)
                self.member_reports.get(region, {}).pop(m.key, None)
                if self._latest_member.get(region) == m.key:
                    self._latest_member.pop(region)
                await asyncio.to_thread(self.store.forget_member, region, m.key)
                log.info("forgot a departed balancer", extra={"region": region, "balancer_id": m.name})
            was_alive = self.balancers[region]["alive"]
            self._refresh_region(region)
            if self.balancers[region]["alive"] != was_alive:
                await self._changed(f"{region} {'alive' if not was_alive else 'dead'}: "
                                    f"{'no balancer registered' if not members else 'its balancers left'}")

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
        if request.region not in self.balancers:
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
        members = self.members[request.region]
        registered_fleet = region_cfg.balancer.fleet == "registered"
        if registered_fleet and not request.balancer_id:
            self.metrics.rejected_calls.labels("no_balancer_id").inc()
            return mesh_pb2.RegisterReply(accepted=False, reason=f"{request.region} is a registered fleet: a balancer "
                                                                 "registers under its own id")
        # its own addresses, as it says (the sibling channel and the controller's calls
        # authenticate themselves); a wildcard is never kept: nobody could dial it
        own_grpc = request.member_grpc_address if dialable(request.member_grpc_address) else ""
        own_http = request.member_http_url if _dialable_url(request.member_http_url) else ""
        member = member_of_registration(members, request.balancer_id, own_grpc)
        if member is not None and member.configured and len(members) == 1 and request.balancer_id \
                and member.balancer_id and member.balancer_id != request.balancer_id and member.alive \
                and member.last_seen_ms is not None and _now_ms() - member.last_seen_ms < UNPROBED_REPORT_STALE_S * 1000:
            # a listed region of one balancer takes any id (a restart picks a fresh one), so
            # two live balancers of one config fold onto its one member: say how to fix it
            log.warning("another balancer took the region's only listed member while the last one still reported;"
                        " an Auto Scaling group needs balancer.fleet: registered",
                        extra={"region": request.region, "previous": member.balancer_id,
                               "balancer_id": request.balancer_id})
        if member is None:
            # a balancer the config does not list: a member of the fleet, known by its id,
            # alive by its reports
            member = MemberState(key=request.balancer_id or f"{request.region}-{len(members)}", configured=False,
                                 http_url=own_http, grpc_address=own_grpc, probe_url="")
            members.append(member)
        elif not member.configured:
            # the same id again (a restarted process on the same instance): its addresses now
            member.grpc_address, member.http_url = own_grpc or member.grpc_address, own_http or member.http_url
        changed = member.balancer_id != request.balancer_id or member.instance_epoch != request.epoch
        member.balancer_id = request.balancer_id
        # what its sibling messages carry: siblings refuse any other epoch for this id
        member.instance_epoch = int(request.epoch)
        self.member_reports.setdefault(request.region, {}).pop(member.key, None)  # an earlier process's
        # the controller issues the epoch (each registration its own, monotonic over the
        # region's balancers, persisted before it is handed out); the caller's own
        # request.epoch is ignored
        epoch = max(m.epoch for m in members) + 1
        epoch = max(epoch, int(self.balancers[request.region]["epoch"] or 0) + 1)
        member.epoch = epoch
        await asyncio.to_thread(self.store.save_member_epoch, request.region, member.key, member.balancer_id, epoch)
        self._latest_member[request.region] = member.key
        was_alive = member.alive
        member.draining = False
        await self._set_alive(request.region, True, f"registered (epoch {epoch})", member)
        if changed and was_alive:
            # a restarted balancer (new id): persist and push
            await self._changed(f"{request.region} registered {member.name} epoch {epoch}")
        log.info("balancer registered", extra={"region": request.region, "balancer_id": request.balancer_id,
                                               "member": member.key, "epoch": epoch,
                                               "version_reported": request.version})
        return mesh_pb2.RegisterReply(accepted=True, topology=self.topology(), epoch=epoch)

    async def Report(self, request: Any, context: Any) -> Any:  # noqa: N802
        b = self.balancers.get(request.region)
        if b is None:
            return mesh_pb2.ReportReply(topology_version=self.version)
        await self._authorize_region(request.region, context)
        members = self.members[request.region]
        member = registered_member(members, request.balancer_id) or (members[0] if len(members) == 1 else None)
        if member is None or request.epoch < member.epoch:
            # a report from an older registration of the balancer (or of none); an epoch
            # larger than the issued one is not believed (and changes nothing)
            return mesh_pb2.ReportReply(topology_version=self.version)
        try:
            report = json.loads(request.admin_json) if request.admin_json else {}
        except json.JSONDecodeError:
            report = {}
        if not isinstance(report, dict):
            report = {}
        self.reports[request.region] = report
        self.last_reports[request.region] = request
        self.member_reports.setdefault(request.region, {})[member.key] = MemberReport(report, request, _now_ms())
        if request.balancer_id:
            member.balancer_id = request.balancer_id
            # a balancer reporting before it registered (a controller restarted under it)
            # names its region until a registration does
            self._latest_member.setdefault(request.region, member.key)
        await self._set_alive(request.region, True, "report", member)
        await self._watch_siblings(request.region)
        now = _now_ms()
        await asyncio.to_thread(self.store.save_report, request.region, report, now,
                                request.SerializeToString())
        return mesh_pb2.ReportReply(topology_version=self.version)

    async def Deregister(self, request: Any, context: Any) -> Any:  # noqa: N802
        b = self.balancers.get(request.region)
        if b is None:
            return mesh_pb2.DeregisterReply(accepted=False, reason=f"unknown region {request.region!r}",
                                            topology_version=self.version)
        await self._authorize_region(request.region, context)
        member = registered_member(self.members[request.region], request.balancer_id)
        if member is None or request.epoch != member.epoch or request.balancer_id != member.balancer_id:
            # only a current registration may take its balancer out: a stale process (or
            # a replayed call) must not black out the balancer that replaced it
            self.metrics.rejected_calls.labels("stale_deregister").inc()
            return mesh_pb2.DeregisterReply(
                accepted=False, topology_version=self.version,
                reason=f"not the current registration of {request.region} (epoch {b['epoch']})")
        member.draining = True
        member.failures = 0
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
            b = self.balancers[r.name]
            rs = st.regions.add(region=r.name, balancer_alive=b["alive"], balancer_id=b["balancer_id"],
                                last_seen_unix_ms=b["last_seen_ms"] or 0)
            self._add_members(rs.members, r.name)
            if r.name in self.last_reports:
                rs.last_report.CopyFrom(self.last_reports[r.name])
        return st

    # ------------------------------------------------------------------ HTTP (status)

    def status_json(self) -> dict[str, Any]:
        homes = self.home_of()
        roles = self.replica_roles()
        regions = []
        for r in self.cfg.regions:
            b = self.balancers[r.name]
            regions.append({
                "region": r.name,
                "balancer_alive": b["alive"],
                # deregistered (SIGTERM drain): out until it registers again
                "balancer_draining": bool(b.get("draining")),
                "balancer_id": b["balancer_id"],
                "balancer_epoch": b["epoch"],
                "balancer_url": b["http_url"],
                "balancer_grpc": b["grpc_address"],
                "last_seen_unix_ms": b["last_seen_ms"],
                # the region's balancers (a fleet behind its entry); alive: any of them
                "balancers": [m.as_json() for m in self.members[r.name]],
                "owned_replicas": [
                    {"replica_id": rid, "url": homes[rid][1], "home_region": homes[rid][0], "role": roles[rid]}
                    for rid, o in sorted(self.owners.items()) if o == r.name
                ],
                "nearest_alive": nearest_alive(self.cfg, r.name, self.alive_regions()),
                "report": self.reports.get(r.name) if b["alive"] else None,
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
            loops.append(("entry-targets", lambda: entry.run(self.members, lambda: self.cfg.controller.probe_interval_s),
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
