"""The balancer's links to the rest of the mesh: gRPC heartbeats with peer balancers
(SkyWalker's availability exchange) and the controller link (register, report, watch
topology). Both are optional and failure-tolerant: the data plane serves from its last
known state when peers or the controller are unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from skymesh.balancer.grpc_streams import answer_stream
from skymesh.balancer.ports import (
    VERSION,
    ControllerLinkBalancer,
    MeshServicesBalancer,
    PeerMeshBalancer,
    SiblingLinkBalancer,
    StatusReport,
)
from skymesh.balancer.sibling_link import SiblingLink
from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.runtime.procs import cancel_tasks, wait_event
from skymesh.runtime.supervise import RestartHook, SupervisedLoop
from skymesh.security.pki import (
    CONTROLLER_SERVER_NAME,
    Credentials,
    balancer_server_name,
    peer_identity,
    region_of_identity,
    require_credentials_off_loopback,
    secure_channel,
)

log = logging.getLogger("skymesh.balancer.mesh")
# each dial attempt gets a subchannel of its own: gRPC shares subchannels between channels
# to one address, and one that failed sits in gRPC's own reconnect backoff (about 1 s,
# jittered), so a dial made at once (a peer said to be back) failed without dialling
OWN_SUBCHANNEL = (("grpc.use_local_subchannel_pool", 1),)


class SupervisedService:
    """Runs a service's background loops supervised (see skymesh.runtime.supervise) and counts
    their restarts for the balancer's metrics: read ``loop_restarts`` (loop name -> count)
    at scrape time, or set ``on_loop_restart`` to be called on every restart."""

    def __init__(self) -> None:
        self.loop_restarts: dict[str, int] = {}
        self.on_loop_restart: RestartHook | None = None

    def _loop_restarted(self, name: str, exc: BaseException) -> None:
        self.loop_restarts[name] = self.loop_restarts.get(name, 0) + 1
        if self.on_loop_restart is not None:
            self.on_loop_restart(name, exc)

    def _supervised(self, name: str, body: Callable[[], Awaitable[None]], *, backoff_s: float,
                    max_backoff_s: float) -> asyncio.Task[None]:
        return SupervisedLoop(name, body, on_restart=self._loop_restarted, logger=log,
                                      backoff_s=backoff_s, max_backoff_s=max_backoff_s).start()


def rejected_peer_calls(services: Iterable[object]) -> dict[str, int]:
    """Peer heartbeat traffic refused by ``services``' PeerMesh, by reason: a heartbeat
    claiming another region than its stream authenticated as, or a stream from a mesh
    identity that is no peer balancer."""
    out: dict[str, int] = {}
    for svc in services:
        if isinstance(svc, PeerMesh):
            wrong = sum(svc.rejected_heartbeats.values())
            if wrong:
                out["wrong_region"] = out.get("wrong_region", 0) + wrong
            if svc.refused_streams:
                out["not_a_peer"] = out.get("not_a_peer", 0) + svc.refused_streams
    return out


def sibling_link_counts(services: Iterable[object]) -> dict[str, int]:
    """The sibling channel's counters (SiblingLink.counts) of ``services``' PeerMesh; empty
    without one."""
    for svc in services:
        if isinstance(svc, PeerMesh) and svc.sibling_link is not None:
            return svc.sibling_link.counts()
    return {}


def loop_restart_counts(services: Iterable[object]) -> dict[str, int]:
    """Restart counts of all supervised loops of ``services`` (e.g. a balancer's
    ``extra_services``), by loop name: the values of skymesh_loop_restarts_total{loop}."""
    out: dict[str, int] = {}
    for svc in services:
        if isinstance(svc, SupervisedService):
            for name, n in svc.loop_restarts.items():
                out[name] = out.get(name, 0) + n
    return out


class PeerMesh(SupervisedService, mesh_pb2_grpc.MeshPeerServicer):
    """Bidirectional heartbeat streams to every peer balancer.

    Each balancer dials every peer and also answers the peers that dial it, so each pair
    has two streams. A heartbeat proves the path it came on: only those answering the
    stream this balancer dialed make a peer available for offload, since forwarding uses
    the same direction (this balancer connecting to the peer's address). Heartbeats on a
    stream a peer dialed are checked (identity) but not applied: with the link into the
    peer cut, they would keep a peer "available" that no forward can reach. Heartbeats
    carry (epoch, seq); the receiver drops anything older than what it has. A heartbeat is
    sent every interval and at once when this region's availability changes, so a replica
    filling up is seen by peers within one probe interval plus the one-way latency.
    """

    def __init__(self, balancer: PeerMeshBalancer, siblings: SiblingLinkBalancer) -> None:
        """``siblings``: what the sibling channel served on the same listener needs (the
        balancer's SiblingLinkPort; a stand-in may be one object for both)."""
        super().__init__()
        self.balancer = balancer
        self.seq = 0
        self.interval = balancer.heartbeat_interval_s()
        self.changed = asyncio.Event()
        self._last_sent_state: tuple[int, int] | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._subscribers: set[asyncio.Event] = set()
        # per peer region: set to end its dial loop's backoff at once (the controller said
        # that peer is back)
        self._redial: dict[str, asyncio.Event] = {}
        # mesh identity (None: loopback-only local mode without TLS)
        self.creds: Credentials | None = balancer.mesh_credentials()
        # heartbeats dropped because they claimed a region the stream is not authenticated
        # as, by claimed region
        self.rejected_heartbeats: dict[str, int] = {}
        self.refused_streams = 0  # heartbeat streams from a mesh identity that is no peer
        # heartbeats received on a dialed stream and held for the emulated link delay, by
        # region: dropped when that stream breaks (a dead peer's last words must not revive it)
        self._held: dict[str, set[asyncio.TimerHandle]] = {}
        # the region's other balancers, on the same gRPC listener (idle while it knows none:
        # the config may list them, or the controller's topology name them later)
        self.sibling_link: SiblingLink | None = SiblingLink(
            siblings, lambda name, body: self._supervised(name, body, backoff_s=0.05, max_backoff_s=1.0))
        siblings.on_dispatch_round(self.notify_state)  # a heartbeat as soon as availability moves

    # ------------------------------------------------------------------ what we send

    def heartbeat(self) -> Any:
        b = self.balancer
        self.seq += 1
        snap = b.heartbeat_snapshot(asyncio.get_running_loop().time())
        offloaded_out, offloaded_in = b.offload_counts()
        return mesh_pb2.PeerHeartbeat(
            region=b.region,
            balancer_id=b.balancer_id,
            epoch=b.epoch,
            seq=self.seq,
            replicas_total=snap.replicas_total,
            replicas_available=snap.replicas_available,
            queue_length=snap.queue_length,
            pending_prefill_tokens=snap.pending_prefill_tokens,
            version=VERSION,
            sent_unix_ms=int(time.time() * 1000),
            offloaded_out=offloaded_out,
            offloaded_in=offloaded_in,
            placements_per_s=snap.placements_per_s,
        )

    def notify_state(self) -> None:
        """Called after every dispatch round/probe: wake the senders if availability moved."""
        state = self.balancer.availability()
        if state != self._last_sent_state:
            self._last_sent_state = state
            for ev in self._subscribers:
                ev.set()

    async def _outgoing(self) -> AsyncIterator[Any]:
        ev = asyncio.Event()
        self._subscribers.add(ev)
        try:
            while True:
                yield self.heartbeat()
                await wait_event(ev, self.interval)  # not wait_for: see procs.wait_event
                ev.clear()
        finally:
            self._subscribers.discard(ev)

    # ------------------------------------------------------------------ what we receive

    def receive(self, hb: Any, stream_region: str | None = None, *, dialed: bool = True) -> None:
        """``stream_region``: the region the stream's peer authenticated as (None only
        without TLS). A heartbeat claiming any other region is dropped and counted.
        ``dialed``: it came on a stream this balancer opened (only those are applied)."""
        b = self.balancer
        peers = b.peer_regions()
        if self.creds is not None and hb.region != stream_region:
            # keyed by the claimed region only when it is a configured one: a caller must
            # not grow this map (or a metrics label) with names of its own choosing
            claimed = hb.region if hb.region in peers or hb.region == b.region else "other"
            self.rejected_heartbeats[claimed] = self.rejected_heartbeats.get(claimed, 0) + 1
            log.warning("dropped a heartbeat claiming another region",
                        extra={"claimed": hb.region, "authenticated": stream_region or "none"})
            return
        if hb.region == b.region or hb.region not in peers or not dialed:
            return
        delay = b.heartbeat_delay_s(hb.region)
        loop = asyncio.get_running_loop()
        if delay > 0:
            held = self._held.setdefault(hb.region, set())

            def apply_held() -> None:
                held.discard(handle)
                self._apply(hb)

            handle = loop.call_later(delay, apply_held)
            held.add(handle)
        else:
            self._apply(hb)

    def stream_broke(self, region: str) -> None:
        """The heartbeat stream this balancer dialed to ``region`` ended after heartbeats
        had come on it: the path forwards take is gone (its balancer died, or the link).
        The peer is declared dead now rather than at its heartbeat timeout."""
        for handle in self._held.pop(region, set()):
            handle.cancel()
        self.balancer.peer_down(region, "heartbeat stream broke")

    def _apply(self, hb: Any) -> None:
        self.balancer.apply_peer_heartbeat(
            hb.region,
            HeartbeatSnapshot(
                replicas_total=hb.replicas_total,
                replicas_available=hb.replicas_available,
                queue_length=hb.queue_length,
                pending_prefill_tokens=hb.pending_prefill_tokens,
                placements_per_s=hb.placements_per_s,
            ),
            asyncio.get_running_loop().time(),
            balancer_id=hb.balancer_id,
            epoch=hb.epoch,
            seq=hb.seq,
        )

    # ------------------------------------------------------------------ gRPC service

    async def Heartbeat(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        stream_region = region_of_identity(peer_identity(context))
        if self.creds is not None and (stream_region is None or stream_region not in self.balancer.peer_regions()):
            # the mesh CA signed it, but it is no peer balancer's certificate
            self.refused_streams += 1
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "only peer balancers may send heartbeats")

        async for hb in answer_stream(request_iterator, lambda m: self.receive(m, stream_region, dialed=False),
                                      self._outgoing()):
            yield hb

    async def Siblings(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        if self.sibling_link is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this balancer's region has no siblings")
            return
        async for pb in self.sibling_link.serve(request_iterator, context):
            yield pb

    def redial(self, region: str) -> None:
        """Dial ``region``'s heartbeat stream now if it is not up (its balancer is back,
        says the controller): the next attempt does not wait out the backoff (up to 2 s)."""
        ev = self._redial.get(region)
        if ev is not None:
            ev.set()

    async def _dial(self, region: str) -> None:
        backoff = self.interval
        redial = self._redial.setdefault(region, asyncio.Event())
        loop = asyncio.get_running_loop()
        failed_attempts, broke_at = 0, None
        while True:
            address = self.balancer.peer_grpc_address(region)
            if address is None:
                return
            heard = False
            redial.clear()  # a wake-up from before this attempt is spent by it
            attempt_at = loop.time()
            try:
                # TLS verifies that whoever answers at the address holds region's key
                channel = (grpc.aio.insecure_channel(address, options=OWN_SUBCHANNEL) if self.creds is None
                           else secure_channel(address, self.creds, balancer_server_name(region), OWN_SUBCHANNEL))
                async with channel:
                    stub = mesh_pb2_grpc.MeshPeerStub(channel)
                    call = stub.Heartbeat(self._outgoing())
                    async for hb in call:
                        if not heard and failed_attempts:
                            log.info("heartbeat stream to peer back", extra={
                                "peer": region, "failed_attempts": failed_attempts,
                                "down_s": round(attempt_at - broke_at, 3) if broke_at is not None else None,
                                "attempt_took_s": round(loop.time() - attempt_at, 3)})
                        if not heard:
                            failed_attempts, broke_at = 0, None
                        backoff = self.interval
                        heard = True
                        self.receive(hb, region)
            except (grpc.aio.AioRpcError, grpc.RpcError, OSError) as e:
                # a peer that is down or restarting is routine; anything else is a bug and
                # goes to the supervisor (logged, counted, redialled)
                log.debug("heartbeat stream to %s ended: %s", region, type(e).__name__)
            if heard:
                self.stream_broke(region)
                broke_at = loop.time()
            else:
                failed_attempts += 1
                log.debug("heartbeat dial to %s failed after %.3f s", region, loop.time() - attempt_at)
            if await wait_event(redial, backoff):
                backoff = self.interval  # told it is back: dial now, and soon again if refused
            else:
                backoff = min(2.0, backoff * 2)

    async def start(self) -> None:
        server = grpc.aio.server()
        mesh_pb2_grpc.add_MeshPeerServicer_to_server(self, server)
        g = self.balancer.grpc_listen()
        require_credentials_off_loopback(g.host, self.creds, f"the {self.balancer.region} balancer")
        # the port actually bound (the config's, or the kernel's pick for port 0)
        if self.creds is not None:
            self.bound_port = server.add_secure_port(f"{g.host}:{g.port}", self.creds.server_credentials())
        else:
            self.bound_port = server.add_insecure_port(f"{g.host}:{g.port}")
        await server.start()
        self._server = server
        for region in self.balancer.peer_regions():
            self._tasks.append(self._supervised(f"hb-{region}", functools.partial(self._dial, region),
                                                backoff_s=self.interval, max_backoff_s=2.0))
        self._tasks.append(self._supervised("hb-state", self._watch_state, backoff_s=0.1, max_backoff_s=2.0))
        if self.sibling_link is not None:
            await self.sibling_link.start()

    async def _watch_state(self) -> None:
        # availability moves in dispatch rounds (every probe, arrival, finish and lease
        # wakes one: notify_state is their listener, so a heartbeat goes out in the same
        # loop turn); this poll only catches a move outside one, within a heartbeat
        # interval. It polled at a quarter of the probe interval before: 40 wake-ups a
        # second of an idle balancer, a tenth of a fleet member's idle CPU
        # (docs/benchmarks.md, "A region is a fleet (live)")
        while True:
            self.notify_state()
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self.sibling_link is not None:
            await self.sibling_link.stop()
        await cancel_tasks(self._tasks)
        if self._server is not None:
            await self._server.stop(grace=0.2)


class ControllerLink(SupervisedService):
    """Register with the controller, report every second, follow its topology.

    When the controller is unreachable the balancer keeps its last topology (from the
    controller, or the YAML) and keeps serving; it reconnects in the background.
    """

    def __init__(self, balancer: ControllerLinkBalancer, report_interval_s: float = 1.0) -> None:
        super().__init__()
        self.balancer = balancer
        self.report_interval_s = report_interval_s
        self._task: asyncio.Task[Any] | None = None
        self.creds: Credentials | None = balancer.mesh_credentials()
        # the epoch the controller issued to the current registration (0: none yet)
        self.controller_epoch = 0

    async def start(self) -> None:
        self._task = self._supervised("controller-link", self._run, backoff_s=1.0, max_backoff_s=10.0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def prepare_drain(self, timeout_s: float = 2.0) -> bool:
        """Before a drain: stop following the controller (a topology that hands this
        region's replicas away must not pull them from under the requests being drained)
        and deregister, so the controller moves DNS and the replicas to the nearest live
        region now instead of after its probes fail. True when the controller accepted."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if not self.controller_epoch:
            return False  # never registered (controller down since start): nothing to undo
        addr = self.balancer.controller_address()
        channel = (grpc.aio.insecure_channel(addr) if self.creds is None
                   else secure_channel(addr, self.creds, CONTROLLER_SERVER_NAME))
        try:
            async with channel:
                reply = await mesh_pb2_grpc.ControllerStub(channel).Deregister(
                    mesh_pb2.DeregisterRequest(region=self.balancer.region, balancer_id=self.balancer.balancer_id,
                                               epoch=self.controller_epoch, reason="draining"),
                    timeout=timeout_s)
        except (grpc.aio.AioRpcError, grpc.RpcError, OSError) as e:
            # the controller's probes will find the closed listener instead
            log.warning("deregistration failed", extra={"region": self.balancer.region, "error": type(e).__name__})
            return False
        if not reply.accepted:
            log.warning("deregistration refused", extra={"region": self.balancer.region, "reason": reply.reason})
        return bool(reply.accepted)

    async def _run(self) -> None:
        addr = self.balancer.controller_address()
        while True:
            try:
                await self._follow(addr)
            except (grpc.aio.AioRpcError, grpc.RpcError, OSError) as e:
                # the controller being down is routine; anything else is a bug and goes to
                # the supervisor (logged, counted, reconnected)
                log.debug("controller link down: %s", type(e).__name__)
            finally:
                self.balancer.set_controller_connected(False)
            await asyncio.sleep(1.0)

    async def _follow(self, addr: str) -> None:
        """One connection: register, then report and follow the topology until it breaks."""
        channel = (grpc.aio.insecure_channel(addr) if self.creds is None
                   else secure_channel(addr, self.creds, CONTROLLER_SERVER_NAME))
        async with channel:
            stub = mesh_pb2_grpc.ControllerStub(channel)
            reply = await stub.Register(self._register_request(), timeout=3.0)
            self.controller_epoch = reply.epoch
            self.balancer.set_controller_connected(True)
            if reply.HasField("topology"):
                self.apply_topology(reply.topology)
            reporter = self._supervised("controller-report", functools.partial(self._report_loop, stub),
                                        backoff_s=self.report_interval_s, max_backoff_s=10.0)
            try:
                async for topo in stub.WatchTopology(
                    mesh_pb2.WatchRequest(region=self.balancer.region, balancer_id=self.balancer.balancer_id)
                ):
                    self.apply_topology(topo)
            finally:
                await cancel_tasks([reporter])

    def _register_request(self) -> Any:
        r = self.balancer.registration()
        return mesh_pb2.RegisterRequest(
            region=r.region,
            balancer_id=r.balancer_id,
            epoch=r.epoch,
            http_url=r.http_url,
            grpc_address=r.grpc_address,
            version=r.version,
            member_grpc_address=r.member_grpc_address,
            member_http_url=r.member_http_url,
        )

    async def _report_loop(self, stub: Any) -> None:
        while True:
            try:
                await stub.Report(self.report(), timeout=3.0)
            except (grpc.aio.AioRpcError, grpc.RpcError) as e:
                # one lost report is harmless (the next supersedes it) and a dead link
                # ends the WatchTopology stream, which reconnects
                log.debug("report failed: %s", type(e).__name__)
            await asyncio.sleep(self.report_interval_s)

    def report(self) -> Any:
        b = self.balancer
        status: StatusReport = b.status_report()
        reps = [
            mesh_pb2.ReplicaReport(
                replica_id=r.replica_id,
                url=r.url,
                healthy=r.healthy,
                available=r.available,
                num_running=r.num_running,
                num_waiting=r.num_waiting,
                kv_cache_usage=r.kv_cache_usage,
                owner_region=b.region,
                role=r.role,
            )
            for r in status.replicas
        ]
        return mesh_pb2.BalancerReport(
            region=b.region,
            balancer_id=b.balancer_id,
            # the controller's epoch for this registration (it ignores any other)
            epoch=self.controller_epoch,
            queue_length=status.queue_length,
            offloaded_out=status.offloaded_out,
            offloaded_in=status.offloaded_in,
            prefix_hit_ratio=status.prefix_hit_ratio,
            replicas=reps,
            admin_json=json.dumps(status.admin),
            unresponsive_siblings=b.unresponsive_siblings(),
        )

    def apply_topology(self, topo: Any) -> None:
        self.balancer.apply_topology(topo)


def attach_services(b: MeshServicesBalancer, *, peers: bool = True, controller: bool = True) -> None:
    # the gRPC listener serves peers' heartbeats and the region's siblings
    peer_port, sibling_port = b.peer_mesh_port, b.sibling_link_port
    if (peers and peer_port.peer_regions() and peer_port.offload_enabled()) or sibling_port.expects_siblings():
        b.extra_services.append(PeerMesh(peer_port, sibling_port))
    if controller:
        b.extra_services.append(ControllerLink(b.controller_link_port))
