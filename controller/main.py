"""`skymesh controller --config FILE`: run the central controller."""

from __future__ import annotations

import argparse
import sys

from controller.reload_rules import reload_controller
from controller.service import ControllerService
from skymesh.config import ConfigError, HostPort, MeshConfig, load_config, load_config_digest
from skymesh.dns.factory import make_provider
from skymesh.runtime.logging_setup import setup_logging
from skymesh.runtime.procs import READY_HELP, report_ready, run_daemon, serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = READY_HELP + ' Keys: "grpc", "http".'
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local mesh)")
    p.add_argument("--state-path", default=None, help="override controller.state_path")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="listen on this gRPC port instead of controller.listen's (0: any free one, reported)")
    p.add_argument("--http-port", type=int, default=None,
                   help="listen on this HTTP port instead of controller.http_listen's (0: any free one, reported)")
    p.add_argument("--log-level", default="INFO")
    p.description = ("SIGHUP reloads the config file: each region's replicas, balancers' public IPs and "
                     "AWS regions, the Route53 TTL, probe settings, latencies and the admin token apply "
                     "live (a new topology is pushed); a file changing anything else the controller "
                     "reads is refused as a whole (see docs/deploy.md).")


async def serve(args: argparse.Namespace) -> int:
    def prepare(cfg: MeshConfig) -> MeshConfig:  # the command line's overrides, at start and on reload
        ctl = cfg.controller
        if args.state_path:
            ctl = ctl.model_copy(update={"state_path": args.state_path})
        # model_copy: the config models are frozen (the overrides need no re-validation)
        if args.grpc_port is not None:
            ctl = ctl.model_copy(update={"listen": HostPort(host=ctl.listen.host, port=args.grpc_port)})
        if args.http_port is not None:
            ctl = ctl.model_copy(update={"http_listen": HostPort(host=ctl.http_listen.host, port=args.http_port)})
        return cfg.model_copy(update={"controller": ctl})

    cfg, digest = load_config_digest(args.config)
    svc = ControllerService(prepare(cfg), make_provider(cfg), config_sha256=digest)

    async def start() -> None:
        await svc.start()
        report_ready(svc.bound_ports)

    async def reload() -> None:  # SIGHUP
        await reload_controller(svc, args.config, prepare)

    return await serve_until_signal(start, svc.stop, reload)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        load_config(args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    bad_ports = [f"--{k}-port must be 0-65535, got {v}" for k, v in (("grpc", args.grpc_port),
                 ("http", args.http_port)) if v is not None and not 0 <= v <= 65535]
    if bad_ports:
        print("skymesh controller: " + "; ".join(bad_ports), file=sys.stderr)
        return 2
    return run_daemon("controller", serve(args))
