"""`skymesh dns --config FILE`: run the embedded authoritative DNS server alone."""

from __future__ import annotations

import argparse
import sys

from skymesh.config import ConfigError, HostPort, load_config
from skymesh.dns.embedded import MeshDnsServer
from skymesh.runtime.logging_setup import setup_logging
from skymesh.runtime.procs import READY_HELP, report_ready, run_daemon, serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = READY_HELP + (' Keys: "dns" (UDP and TCP), "control" (the HTTP endpoint the controller'
                             ' pushes to; the DNS port + 1 unless the port is 0).')
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local mesh)")
    p.add_argument("--port", type=int, default=None,
                   help="serve DNS on this port instead of dns.listen's (0: any free one, reported)")
    p.add_argument("--log-level", default="INFO")


async def serve(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.port is not None:
        assert cfg.dns.listen is not None  # run() checked
        # model_copy: the config models are frozen
        dns = cfg.dns.model_copy(update={"listen": HostPort(cfg.dns.listen.host, args.port)})
        cfg = cfg.model_copy(update={"dns": dns})
    srv = MeshDnsServer(cfg)

    async def start() -> None:
        await srv.start()
        report_ready(srv.bound_ports)

    return await serve_until_signal(start, srv.stop)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.dns.listen is None:
        print("config error: dns.listen is required for the embedded DNS server", file=sys.stderr)
        return 2
    if args.port is not None and not 0 <= args.port <= 65535:
        print(f"skymesh dns: --port must be 0-65535, got {args.port}", file=sys.stderr)
        return 2
    return run_daemon("dns", serve(args))
