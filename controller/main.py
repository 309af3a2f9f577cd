"""`skymesh controller --config FILE`: run the central controller."""

from __future__ import annotations

import argparse
import asyncio
import sys

from skymesh.config import ConfigError, load_config
from skymesh.logging_setup import setup_logging
from skymesh.procs import serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local mesh)")
    p.add_argument("--state-path", default=None, help="override controller.state_path")
    p.add_argument("--log-level", default="INFO")


async def serve(args: argparse.Namespace) -> int:
    from controller.service import ControllerService
    from skymesh.dns.factory import make_provider

    cfg = load_config(args.config)
    if args.state_path:
        # model_copy: the config models are frozen (and the path needs no re-validation)
        controller = cfg.controller.model_copy(update={"state_path": args.state_path})
        cfg = cfg.model_copy(update={"controller": controller})
    svc = ControllerService(cfg, make_provider(cfg))
    return await serve_until_signal(svc.start, svc.stop)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        load_config(args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(args))
