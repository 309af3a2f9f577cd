"""`skymesh dns --config FILE`: run the embedded authoritative DNS server alone."""

from __future__ import annotations

import argparse
import asyncio
import sys

from skymesh.config import ConfigError, load_config
from skymesh.logging_setup import setup_logging
from skymesh.procs import serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local mesh)")
    p.add_argument("--log-level", default="INFO")


async def serve(args: argparse.Namespace) -> int:
    from skymesh.dns.embedded import MeshDnsServer

    srv = MeshDnsServer(load_config(args.config))
    return await serve_until_signal(srv.start, srv.stop)


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
    return asyncio.run(serve(args))
