"""`skymesh balancer --config FILE --region NAME [--member K]`: run one balancer of a region."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from skymesh.balancer.autoscaling_signal import attach_autoscaling_signal
from skymesh.balancer.identity import resolve_identity
from skymesh.balancer.reload_rules import reload_balancer
from skymesh.balancer.server import Balancer
from skymesh.balancer.services import attach_services
from skymesh.config import (
    BalancerConfig,
    ConfigError,
    HostPort,
    MeshConfig,
    load_config,
    load_config_digest,
)
from skymesh.runtime.gc_tuning import tune_gc
from skymesh.runtime.logging_setup import setup_logging
from skymesh.runtime.procs import READY_HELP, report_ready, run_daemon, serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = READY_HELP + ' Keys: "http", "grpc" when it serves peers, "peer" when it has a peer listener.'
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local mesh)")
    p.add_argument("--region", required=True, help="which region of the config this balancer serves")
    p.add_argument("--policy", default=None, help="override the config's routing policy")
    p.add_argument("--member", type=int, default=0,
                   help="which balancer of the region's fleet this is: 0 the region's `balancer:` listeners,"
                        " K its balancer.siblings[K-1] (default 0); its id is the member's unless --balancer-id")
    p.add_argument("--balancer-id", default=None,
                   help="this balancer's id (default: SKYMESH_BALANCER_ID, the listed member's, in a registered"
                        " fleet the EC2 instance id, else a fresh one per process)")
    p.add_argument("--advertise-host", default=None,
                   help="the host its siblings and the controller reach this balancer at (default:"
                        " SKYMESH_ADVERTISE_HOST, in a registered fleet or on a wildcard listener the EC2"
                        " private IPv4, else its listen host)")
    p.add_argument("--listen-host", default=None,
                   help="bind every listener (HTTP, gRPC, peer) on this host instead of the config's")
    p.add_argument("--no-controller", action="store_true", help="run from the YAML alone")
    p.add_argument("--no-peers", action="store_true", help="region-local: no heartbeats, no offload")
    p.add_argument("--http-port", type=int, default=None,
                   help="listen on this HTTP port instead of the config's (0: any free one, reported)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="listen on this gRPC port instead of the config's (0: any free one, reported)."
                        " The advertised addresses stay the config's: use these for a balancer that"
                        " nobody finds through the config (benchmarks, --no-peers --no-controller)")
    p.add_argument("--peer-port", type=int, default=None,
                   help="run the peer listener (forwards from peer balancers, mTLS) on this port instead"
                        " of the config's peer_listen port (0: any free one, reported)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: stop accepting, let accepted requests finish for at most this long")
    p.add_argument("--drain-listen-s", type=float, default=0.0,
                   help="on SIGTERM/SIGINT: first fail /health while still serving new connections this long,"
                        " so a load balancer in front stops sending them (at least its health-check interval"
                        " times its unhealthy threshold); then stop accepting (default 0)")
    p.add_argument("--log-level", default="INFO")
    p.description = ("SIGHUP reloads the config file: client keys and limits, the admin token, timeouts, "
                     "health, queue and retry bounds, offload rules (and the replica list with "
                     "--no-controller) apply live; a file changing anything else is refused as a whole "
                     "(see docs/deploy.md).")


def as_member(cfg: MeshConfig, region: str, member: int) -> MeshConfig:
    """``cfg`` with ``region``'s balancer listening on member ``member``'s listeners (the
    advertised addresses, the region's entry, stay as configured)."""
    if member == 0:
        return cfg
    m = cfg.region(region).balancer_members[member]
    regions = tuple(
        r.model_copy(update={"balancer": r.balancer.model_copy(update={
            "listen": m.listen, "grpc_listen": m.grpc_listen, "peer_listen": m.peer_listen})})
        if r.name == region else r
        for r in cfg.regions
    )
    return cfg.model_copy(update={"regions": regions})


def member_balancer_id(cfg: MeshConfig, region: str, member: int, given: str | None) -> str | None:
    """The balancer id: ``given``, else the member's own in a region of several balancers,
    else None (a fresh one per process, as a region of one balancer always had)."""
    if given is not None:
        return given
    members = cfg.region(region).balancer_members
    return members[member].id if len(members) > 1 else None


def static_siblings(cfg: MeshConfig, region: str, member: int) -> dict[str, str]:
    """The region's other balancers the config lists: id -> its own gRPC listener (from
    the config as written, before this member's listeners replace the first's)."""
    return {m.id: str(m.grpc_listen) for m in cfg.region(region).balancer_members if m.index != member}


def with_listen_ports(cfg: MeshConfig, region: str, http_port: int | None, grpc_port: int | None,
                      peer_port: int | None = None, host: str | None = None) -> MeshConfig:
    """``cfg`` with ``region``'s balancer listening on the given ports (None: the config's;
    a peer port without a configured peer_listen listens on the HTTP listen host) and, with
    ``host``, on that host."""

    def override(hp: HostPort, port: int | None) -> HostPort:
        return HostPort(host or hp.host, hp.port if port is None else port)

    def peer(b: BalancerConfig) -> HostPort | None:
        if peer_port is None:
            return None if b.peer_listen is None else override(b.peer_listen, None)
        return HostPort(host or (b.peer_listen or b.listen).host, peer_port)

    # model_copy: the config models are frozen; the advertised addresses stay as validated
    regions = tuple(
        r.model_copy(update={"balancer": r.balancer.model_copy(update={
            "listen": override(r.balancer.listen, http_port),
            "grpc_listen": override(r.balancer.grpc_listen, grpc_port),
            "peer_listen": peer(r.balancer)})})
        if r.name == region else r
        for r in cfg.regions
    )
    return cfg.model_copy(update={"regions": regions})


async def serve(args: argparse.Namespace) -> int:
    def prepare(cfg: MeshConfig) -> MeshConfig:  # the command line's overrides, at start and on reload
        return with_listen_ports(as_member(cfg, args.region, args.member), args.region, args.http_port,
                                 args.grpc_port, args.peer_port, host=args.listen_host)

    cfg, digest = load_config_digest(args.config)
    prepared = prepare(cfg)
    identity = await asyncio.to_thread(
        resolve_identity, cfg, args.region, args.member, listen_host=prepared.region(args.region).balancer.listen.host,
        balancer_id=args.balancer_id, advertise_host=args.advertise_host, environ=dict(os.environ))
    logging.getLogger("skymesh.balancer").info("member identity", extra={
        "region": args.region, "balancer_id": identity.balancer_id or "(fresh)", "id_source": identity.id_source,
        "advertise_host": identity.advertise_host or "(listen host)", "host_source": identity.host_source})
    balancer = Balancer(prepared, args.region, balancer_id=identity.balancer_id, policy_name=args.policy,
                        config_sha256=digest, static_siblings=static_siblings(cfg, args.region, args.member),
                        advertise_host=identity.advertise_host)
    attach_services(balancer, peers=not args.no_peers, controller=not args.no_controller)
    attach_autoscaling_signal(balancer)  # with autoscaling.cloudwatch: the signal to CloudWatch

    async def start() -> None:
        await balancer.start()
        tune_gc()
        ports = {"http": balancer.bound_port}
        if balancer.peer_port is not None:
            ports["peer"] = balancer.peer_port
        for svc in balancer.extra_services:
            if isinstance(getattr(svc, "bound_port", None), int):  # the peers' gRPC server
                ports["grpc"] = svc.bound_port
        report_ready(ports)

    async def stop() -> None:
        await balancer.stop(drain_timeout_s=args.drain_timeout_s, drain_listen_s=args.drain_listen_s)

    async def reload() -> None:  # SIGHUP; without a controller the file's replica list is ours
        await reload_balancer(balancer, args.config, prepare, own_replicas=args.no_controller)

    return await serve_until_signal(start, stop, reload)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        cfg = load_config(args.config)
        members = cfg.region(args.region).balancer_members
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyError:
        print(f"config error: no region named {args.region!r}", file=sys.stderr)
        return 2
    if not 0 <= args.member < len(members):
        print(f"config error: region {args.region!r} has {len(members)} balancer(s) (members 0-{len(members) - 1}),"
              f" no member {args.member}", file=sys.stderr)
        return 2
    bad_ports = [f"--{k}-port must be 0-65535, got {v}" for k, v in (("http", args.http_port),
                 ("grpc", args.grpc_port), ("peer", args.peer_port)) if v is not None and not 0 <= v <= 65535]
    if bad_ports:
        print("skymesh balancer: " + "; ".join(bad_ports), file=sys.stderr)
        return 2
    logging.getLogger("skymesh").debug("starting balancer for %s", args.region)
    return run_daemon("balancer", serve(args))
