"""`skymesh up [--config FILE]`: the whole mesh on one machine (what `make run` runs).

Starts, each as its own process (own process group, log under the state dir): the
stand-in replicas of every region (real `url` replicas are only health-checked), the DNS
server, the controller and every balancer of every region (a region with
``balancer.siblings`` runs several); plus, in this process, the delay proxies that give
the advertised addresses their inter-region latency and spread a region's new
connections over its balancers. Waits until every
child reports ready (its SKYMESH_READY line, see skymesh.runtime.procs) and every real replica is
healthy, prints how to use the mesh, and stops everything (reverse order, by PID) on
Ctrl-C / SIGTERM. :class:`Mesh` is also what the integration tests drive: they kill and
restart single parts (a balancer, the controller, the DNS server, a replica). One concern
(~500 lines): the local mesh's processes, from start to stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from skymesh.config import ConfigError, MeshConfig, RegionConfig, load_config
from skymesh.operations.hints import admin_token_shell, query_hints
from skymesh.operations.latency_proxy import LOCAL_DRAIN_LISTEN_S, DelayProxy, proxies_for
from skymesh.operations.observability import write_for_local_mesh
from skymesh.runtime.logging_setup import setup_logging
from skymesh.runtime.procs import (
    Child,
    all_or_first_failure,
    bind_problem,
    cancel_tasks,
    describe_port_holders,
    skymesh_cmd,
    wait_all_ready,
    wait_healthy,
)
from skymesh.security.admin_auth import (
    PEER_TOKEN_ENV,
    ensure_local_token,
    resolve_admin_token,
    resolve_peer_token,
)
from skymesh.security.pki import generate_mesh_pki

log = logging.getLogger("skymesh.operations.up")


class MeshStartError(RuntimeError):
    """A part of the mesh did not come up; the message names it (with its log tail)."""


class Mesh:
    """The processes (and in-process delay proxies) of one mesh config."""

    def __init__(self, config_path: Path, state_dir: Path, time_scale: float | None = None,
                 health_timeout_s: float = 60.0, external_timeout_s: float = 15.0) -> None:
        self.config_path = Path(config_path)
        self.cfg: MeshConfig = load_config(config_path)
        self.state_dir = Path(state_dir)
        if self.cfg.tls is None:
            self.config_path, self.cfg = self._with_generated_identity()
        self.log_dir = self.state_dir / "logs"
        self.time_scale = time_scale
        self.health_timeout_s = health_timeout_s
        self.external_timeout_s = external_timeout_s
        self.replicas: dict[str, Child] = {}  # sim replicas by replica id
        self.replica_restarts: dict[str, int] = {}  # by keep_replicas_running
        self.balancer_members: dict[tuple[str, int], Child] = {}  # by (region, member index)
        self.controller: Child | None = None
        self.dns: Child | None = None
        self.proxies: list[DelayProxy] = []
        # real (url) replicas that did not answer /health at start: the mesh still runs,
        # the balancers keep probing them
        self.unhealthy_external: list[str] = []
        # the admin token of this mesh: the operator's (env / admin.token_file), else one
        # generated once in the state dir; the children get it in their environment and
        # `skymesh status --state-dir` reads the same file
        self.admin_token = resolve_admin_token(self.cfg, state_dir=None) or ensure_local_token(self.state_dir)
        # the peer token likewise: the operator's, else one generated in the state dir
        self.peer_token = resolve_peer_token(self.cfg, ("127.0.0.1",), state_dir=self.state_dir)
        self.child_env = {self.cfg.admin.token_env: self.admin_token, PEER_TOKEN_ENV: self.peer_token}

    @classmethod
    def from_dict(cls, data: dict[str, Any], state_dir: Path, time_scale: float | None = None,
                  **kw: Any) -> Mesh:
        """A mesh from a config mapping (written to ``state_dir/mesh.yaml`` for the children)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / "mesh.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return cls(path, state_dir, time_scale, **kw)

    def _with_generated_identity(self) -> tuple[Path, MeshConfig]:
        """Mesh identity for a config without a ``tls`` section: a local CA and every
        component's credentials under ``state_dir/pki`` (generated once, then reused),
        named in a copy of the config that the children are started with."""
        section = generate_mesh_pki(self.state_dir / "pki", [r.name for r in self.cfg.regions])
        data = yaml.safe_load(self.config_path.read_text())
        data["tls"] = section
        path = self.state_dir / f"{self.config_path.stem}.identity.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path, load_config(path)

    # ------------------------------------------------------------------ checks

    def listen_addresses(self) -> list[tuple[str, str, int, bool]]:
        """(what, host, port, udp) of every address this mesh will listen on."""
        cfg = self.cfg
        out: list[tuple[str, str, int, bool]] = []
        for r in cfg.regions:
            for rep in r.replicas:
                if rep.sim is not None:
                    out.append((f"replica {rep.id}", rep.sim.host, rep.sim.port, False))
                    kv = rep.sim.kv_events
                    if kv is not None:
                        out.append((f"replica {rep.id} KV events", rep.sim.host, kv.port, False))
                        if kv.replay_port is not None:
                            out.append((f"replica {rep.id} KV events replay", rep.sim.host, kv.replay_port, False))
        if cfg.dns.provider == "embedded" and cfg.dns.listen is not None:
            # lazy: `skymesh up` runs the DNS server as a child; dnspython stays out of this process
            from skymesh.dns.embedded import control_address

            out.append(("DNS server (udp)", cfg.dns.listen.host, cfg.dns.listen.port, True))
            out.append(("DNS server (tcp)", cfg.dns.listen.host, cfg.dns.listen.port, False))
            chost, cport = control_address(cfg)
            out.append(("DNS control endpoint", chost, cport, False))
        out.append(("controller gRPC", cfg.controller.listen.host, cfg.controller.listen.port, False))
        out.append(("controller HTTP", cfg.controller.http_listen.host, cfg.controller.http_listen.port, False))
        for r in cfg.regions:
            b = r.balancer
            for m in r.balancer_members:
                who = f"balancer {r.name}" if len(r.balancer_members) == 1 else f"balancer {m.id}"
                out.append((f"{who} HTTP", m.listen.host, m.listen.port, False))
                out.append((f"{who} gRPC", m.grpc_listen.host, m.grpc_listen.port, False))
                if m.peer_listen is not None:
                    out.append((f"{who} peer listener", m.peer_listen.host, m.peer_listen.port, False))
            # the delay proxies, which also spread a fleet's connections (then even without
            # emulate_latency: nothing else serves the region's entry on loopback)
            if cfg.emulate_latency or len(r.balancer_members) > 1:
                if b.advertise != b.listen:
                    out.append((f"delay proxy {r.name} HTTP", b.advertise.host, b.advertise.port, False))
                if b.grpc_advertise != b.grpc_listen:
                    out.append((f"delay proxy {r.name} gRPC", b.grpc_advertise.host, b.grpc_advertise.port, False))
                if b.peer_advertise is not None and b.peer_advertise != b.peer_listen:
                    out.append((f"delay proxy {r.name} peer", b.peer_advertise.host, b.peer_advertise.port, False))
        return out

    def preflight(self) -> None:
        """Fail before starting anything when an address is taken (another `skymesh up`?),
        naming the process that holds it (pid and command line)."""
        problems = []
        for what, host, port, udp in self.listen_addresses():
            why = bind_problem(host, port, udp)
            if why == "already in use":
                why += " " + describe_port_holders(host, port, udp)
            if why is not None:
                problems.append(f"  {what}: {host}:{port} {why}")
        if problems:
            raise MeshStartError(
                "cannot listen on these addresses (is another `skymesh up` running?):\n" + "\n".join(problems)
            )

    # ------------------------------------------------------------------ parts

    def _replica_child(self, region: str, rid: str) -> Child | None:
        rep = next(x for x in self.cfg.region(region).replicas if x.id == rid)
        if rep.sim is None:
            return None
        ts = self.time_scale if self.time_scale is not None else rep.sim.time_scale
        extra: list[str] = []
        if rep.sim.tokenizer is not None:
            extra += ["--tokenizer", rep.sim.tokenizer]
        if rep.sim.kv_events is not None:
            extra += ["--kv-events-config", rep.sim.kv_events.vllm_json()]
        if rep.sim.enable_prompt_tokens_details:
            extra.append("--enable-prompt-tokens-details")
        if rep.sim.kv_transfer is not None:
            extra += rep.sim.kv_transfer.cli_args()
        return Child(f"replica-{rid}", skymesh_cmd(
            "replica-sim", "--host", rep.sim.host, "--port", str(rep.sim.port), "--profile", rep.sim.profile,
            "--time-scale", str(ts), "--model", self.cfg.model, *extra), self.log_dir, env=self.child_env)

    def _region_of_replica(self, rid: str) -> RegionConfig:
        for r in self.cfg.regions:
            if any(x.id == rid for x in r.replicas):
                return r
        raise KeyError(rid)

    async def start_proxies(self) -> None:
        for p in proxies_for(self.cfg, admin_token=self.admin_token):
            try:
                await p.start()
            except OSError as e:
                why = e.strerror or str(e)
                if e.errno == errno.EADDRINUSE:
                    why += " " + describe_port_holders(p.listen[0], p.listen[1])
                raise MeshStartError(f"delay proxy {p.name} cannot listen: {why}") from None
            self.proxies.append(p)

    async def start_replicas(self) -> None:
        """Every sim replica (healthy on return) and a /health check of every real one."""
        sims: list[Child] = []
        external: list[tuple[str, str]] = []
        for r in self.cfg.regions:
            for rep in r.replicas:
                child = self._replica_child(r.name, rep.id)
                if child is None:
                    external.append((rep.id, rep.url))
                    continue
                child.start()
                self.replicas[rep.id] = child
                sims.append(child)

        async def check(rid: str, url: str) -> str | None:
            try:
                await wait_healthy(url + "/health", None, within_s=self.external_timeout_s)
            except TimeoutError:
                return rid
            return None

        ext = asyncio.gather(*(check(rid, url) for rid, url in external))
        try:
            await wait_all_ready(sims, within_s=self.health_timeout_s)
        except BaseException:
            ext.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ext
            raise
        self.unhealthy_external = [rid for rid in await ext if rid is not None]
        for rid in self.unhealthy_external:
            log.warning("replica not healthy at start; the balancers keep probing it",
                        extra={"replica": rid, "url": next(u for i, u in external if i == rid)})

    async def start_replica(self, rid: str) -> None:
        """(Re)start one sim replica and wait until it is healthy."""
        region = self._region_of_replica(rid)
        old = self.replicas.get(rid)
        if old is not None and old.running():
            raise MeshStartError(f"replica {rid} is already running (pid {old.pid})")
        child = self._replica_child(region.name, rid)
        if child is None:
            raise MeshStartError(f"replica {rid} is a real server (url), not started by skymesh")
        child.start()
        self.replicas[rid] = child
        await child.wait_ready(within_s=self.health_timeout_s)

    async def stop_replica(self, rid: str, kill: bool = False) -> None:
        child = self.replicas.get(rid)
        if child is not None:
            await (child.kill() if kill else child.stop())

    async def keep_replicas_running(self, *, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                                    healthy_after_s: float = 60.0, check_every_s: float = 0.5) -> None:
        """Restart a stand-in replica that died, with a per-replica backoff that doubles up
        to ``max_backoff_s`` and starts over once it has run ``healthy_after_s``. Runs until
        cancelled. A replica that fails to come back is tried again after its backoff."""
        loop = asyncio.get_running_loop()
        backoff: dict[str, float] = {}
        started_at: dict[str, float] = {rid: loop.time() for rid in self.replicas}
        next_try: dict[str, float] = {}
        while True:
            await asyncio.sleep(check_every_s)
            now = loop.time()
            for rid, child in list(self.replicas.items()):
                if child.returncode is None:
                    if now - started_at.get(rid, now) >= healthy_after_s:
                        backoff.pop(rid, None)
                    continue
                if rid not in next_try:
                    wait = backoff.get(rid, backoff_s)
                    next_try[rid] = now + wait
                    backoff[rid] = min(max_backoff_s, wait * 2)
                    log.warning("replica exited; restarting after backoff",
                                extra={"replica": rid, "code": child.returncode, "backoff_s": wait})
                    continue
                if now < next_try[rid]:
                    continue
                del next_try[rid]
                try:
                    await self.start_replica(rid)
                    started_at[rid] = loop.time()
                    self.replica_restarts[rid] = self.replica_restarts.get(rid, 0) + 1
                except (MeshStartError, RuntimeError, TimeoutError) as e:
                    log.warning("replica restart failed", extra={"replica": rid, "error": str(e)})

    async def start_dns(self) -> None:
        if self.cfg.dns.provider != "embedded":
            return
        if self.dns is not None and self.dns.running():
            raise MeshStartError(f"the DNS server is already running (pid {self.dns.pid})")
        self.dns = Child("dns", skymesh_cmd("dns", "--config", str(self.config_path)), self.log_dir,
                         env=self.child_env)
        self.dns.start()
        await self.dns.wait_ready(within_s=self.health_timeout_s)

    async def stop_dns(self, kill: bool = False) -> None:
        if self.dns is not None:
            await (self.dns.kill() if kill else self.dns.stop())

    async def start_controller(self) -> None:
        if self.controller is not None and self.controller.running():
            raise MeshStartError(f"the controller is already running (pid {self.controller.pid})")
        self.controller = Child("controller", skymesh_cmd("controller", "--config", str(self.config_path)),
                                self.log_dir, env=self.child_env)
        self.controller.start()
        await self.controller.wait_ready(within_s=self.health_timeout_s)

    async def stop_controller(self, kill: bool = False) -> None:
        if self.controller is not None:
            await (self.controller.kill() if kill else self.controller.stop())

    @property
    def balancers(self) -> dict[str, Child]:
        """Each region's first balancer (member 0: the only one of a region without siblings)."""
        return {region: child for (region, k), child in self.balancer_members.items() if k == 0}

    def _member_indexes(self, region: str, member: int | None) -> list[int]:
        members = self.cfg.region(region).balancer_members
        if member is None:
            return [m.index for m in members]
        if not 0 <= member < len(members):
            raise MeshStartError(f"region {region} has {len(members)} balancer(s), no member {member}")
        return [member]

    async def start_balancer(self, region: str, member: int | None = None) -> None:
        """(Re)start the region's balancer ``member`` (None: every one) and wait until ready."""
        await all_or_first_failure([asyncio.create_task(self._start_member(region, k))
                                    for k in self._member_indexes(region, member)])

    async def _start_member(self, region: str, member: int) -> None:
        old = self.balancer_members.get((region, member))
        members = self.cfg.region(region).balancer_members
        name = region if len(members) == 1 else members[member].id
        if old is not None and old.running():
            raise MeshStartError(f"the {name} balancer is already running (pid {old.pid})")
        # a fleet's member fails its health check for a while before its listener closes, so
        # the region's entry (which checks it) sends a new connection to a sibling instead
        drain_listen = ("--drain-listen-s", str(LOCAL_DRAIN_LISTEN_S)) if len(members) > 1 else ()
        child = Child(f"balancer-{name}", skymesh_cmd(
            "balancer", "--config", str(self.config_path), "--region", region, "--member", str(member),
            *drain_listen), self.log_dir, env=self.child_env)
        child.start()
        self.balancer_members[(region, member)] = child
        await child.wait_ready(within_s=self.health_timeout_s)
        # ready means the region's entry sends it connections too: its health checks must
        # have seen the member pass (they took it out while it was down)
        url = members[member].listen.http_url + "/health"
        checks = {id(p.health): p.health for p in self.proxies if p.health is not None and url in p.health.healthy}
        await asyncio.wait_for(asyncio.gather(*(h.until_passing(url) for h in checks.values())),
                               timeout=self.health_timeout_s)

    async def stop_balancer(self, region: str, kill: bool = False, member: int | None = None) -> None:
        """Stop (SIGTERM, drain) or kill (SIGKILL) the region's balancer ``member`` (None: every one)."""
        children = [self.balancer_members.get((region, k)) for k in self._member_indexes(region, member)]
        await asyncio.gather(*((c.kill() if kill else c.stop()) for c in children if c is not None))

    def cut_links_into(self, region: str) -> int:
        """Fault injection: the other regions' balancers can no longer reach ``region``'s
        (its gRPC and peer-listener delay proxies refuse everyone, its HTTP one the other
        balancers' egress addresses; its own clients and the controller's probes still get in). Open
        connections are reset. Returns how many. :meth:`mend_links_into` undoes it."""
        others = {r.egress_source for r in self.cfg.regions if r.name != region and r.egress_source}
        reset = 0
        for p in self.proxies:
            if p.region == region and p.kind in ("grpc", "peer"):
                reset += p.cut(lambda ip: True)
            elif p.region == region and p.kind == "http":
                reset += p.cut(others.__contains__)
        return reset

    def mend_links_into(self, region: str) -> None:
        for p in self.proxies:
            if p.region == region:
                p.mend()

    # ------------------------------------------------------------------ whole mesh

    async def start(self) -> None:
        """Everything, healthy on return; on any failure what was started is stopped."""
        self.preflight()
        try:
            await self.start_proxies()
            await self.start_replicas()
            await self.start_dns()
            await self.start_controller()
            await all_or_first_failure([asyncio.create_task(self._start_member(r.name, m.index))
                                        for r in self.cfg.regions for m in r.balancer_members])
        except BaseException:
            await self.stop()
            raise

    def children(self) -> list[Child]:
        """Every child process, in start order."""
        out: list[Child] = list(self.replicas.values())
        out += [c for c in (self.dns, self.controller) if c is not None]
        return out + list(self.balancer_members.values())

    async def stop(self) -> None:
        """Reverse start order, by PID: balancers, controller, DNS, replicas, proxies."""
        await asyncio.gather(*(c.stop() for c in self.balancer_members.values()))
        for child in (self.controller, self.dns):
            if child is not None:
                await child.stop()
        await asyncio.gather(*(c.stop() for c in self.replicas.values()))
        for p in reversed(self.proxies):
            await p.stop()
        self.proxies = []

    # ------------------------------------------------------------------ the banner

    def describe(self, config_arg: str | None = None) -> str:
        """What is running and how to query it."""
        cfg = self.cfg
        n_rep = sum(len(r.replicas) for r in cfg.regions)
        lines = [f"skymesh is up: {len(cfg.regions)} regions, {n_rep} replicas, policy {cfg.policy.name}.", ""]
        example = cfg.regions[1] if len(cfg.regions) > 1 else cfg.regions[0]
        ports = {r.balancer.advertise.port for r in cfg.regions}
        # one port everywhere (the local default: 8100): the DNS name alone is the endpoint
        port = example.balancer.advertise.port
        where = f"http://{cfg.dns.name}:{port}" if len(ports) == 1 else f"{cfg.dns.name} (A record; ports per region below)"
        if cfg.dns.provider == "embedded" and cfg.dns.listen is not None:
            lines.append(f"  endpoint       {where}")
            lines.append(f"  DNS server     {cfg.dns.listen} (UDP/TCP, embedded), answers {cfg.dns.name} with the "
                         "nearest healthy balancer for the client's source network")
        else:
            lines.append(f"  endpoint       {where}  (Route53 zone {cfg.dns.hosted_zone})")
        for r in cfg.regions:
            b = r.balancer
            nets = ", ".join(str(n) for n in r.source_networks)
            fleet = f"{len(r.balancer_members)} balancers  " if len(r.balancer_members) > 1 else ""
            lines.append(f"  {r.name:<14} {b.advertise_url}  gRPC {b.grpc_advertise}  "
                         f"{fleet}{len(r.replicas)} replicas  clients from {nets}")
        lines.append(f"  controller     {cfg.controller.http_listen.http_url}/v1/status  (admin token: "
                     f"{admin_token_shell(cfg, self.state_dir)[0]}; curl line below)")
        if cfg.emulate_latency and self.proxies:
            pairs = ", ".join(f"{a}<->{b} {ms:g}" for (a, b), ms in sorted(cfg.latency_ms.items()))
            lines.append(f"  latency        emulated by delay proxies on the advertised addresses "
                         f"(one-way ms: {pairs}; local {cfg.local_latency_ms:g})")
        if self.unhealthy_external:
            lines.append(f"  WARNING        not healthy yet: {', '.join(self.unhealthy_external)}")
        client = _example_client_ip(example)
        lines += ["", *query_hints(cfg, example, client, config_arg, self.state_dir), "",
                  f"Logs: {self.log_dir}/   Ctrl-C stops everything."]
        return "\n".join(lines)


def _example_client_ip(region: RegionConfig) -> str | None:
    """An address in the region's loopback source network a local client can bind."""
    for net in region.source_networks:
        if isinstance(net, ipaddress.IPv4Network) and net.subnet_of(ipaddress.IPv4Network("127.0.0.0/8")) \
                and net.num_addresses > 8:
            return str(net.network_address + 5)
    return None


# ----------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local 3-region mesh)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="override every sim replica's time scale (0.1: ten times faster)")
    p.add_argument("--state-dir", default=".skymesh/run", help="logs and generated files (default .skymesh/run)")
    p.add_argument("--wait-s", type=float, default=60.0, help="how long each part may take to become healthy")


def _config_path(args: argparse.Namespace) -> Path:
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    if args.config is not None:
        return Path(args.config)
    from importlib import resources

    path = state_dir / "local.yaml"
    path.write_text(resources.files("skymesh").joinpath("local.yaml").read_text())
    return path


async def _watch_children(mesh: Mesh) -> None:
    """Say once when a part dies while the mesh is up (the controller fails over; the
    operator should still know)."""
    reported: set[int] = set()
    while True:
        await asyncio.sleep(1.0)
        for child in mesh.children():
            code = child.returncode
            if code is not None and child.pid is not None and child.pid not in reported:
                reported.add(child.pid)
                print(f"warning: {child.name} (pid {child.pid}) exited with {code}; log: {child.log_path}",
                      file=sys.stderr, flush=True)


async def _up(args: argparse.Namespace, path: Path) -> int:
    state_dir = Path(args.state_dir)
    mesh = Mesh(path, state_dir, args.time_scale, health_timeout_s=args.wait_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"starting the mesh from {path} (logs in {mesh.log_dir}/) ...", flush=True)
    start = asyncio.create_task(mesh.start())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():
        start.cancel()  # Mesh.start stops what it started when cancelled
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await start
        await mesh.stop()
        print("stopped before the mesh was up", flush=True)
        return 130
    stopper.cancel()
    try:
        start.result()
    except (MeshStartError, RuntimeError, TimeoutError) as e:
        print(f"the mesh did not come up: {e}", file=sys.stderr, flush=True)
        return 1
    print(mesh.describe(args.config), flush=True)
    print(write_for_local_mesh(mesh.cfg, state_dir), flush=True)
    watcher = asyncio.create_task(_watch_children(mesh))
    restarter = asyncio.create_task(mesh.keep_replicas_running())
    try:
        await stop.wait()
    finally:
        await cancel_tasks([watcher, restarter])
        print("stopping ...", flush=True)
        await mesh.stop()
        print("stopped.", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    setup_logging("WARNING")
    try:
        load_config(args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_up(args, _config_path(args)))
