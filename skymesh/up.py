"""`skymesh up [--config FILE]`: the whole mesh on one machine (what `make run` runs).

Starts, each as its own process (own process group, log under the state dir): the
stand-in replicas of every region (real `url` replicas are only health-checked), the DNS
server, the controller and one balancer per region; plus, in this process, the delay
proxies that give the advertised addresses their inter-region latency. Waits until all
are healthy, prints how to use the mesh, and stops everything (reverse order, by PID) on
Ctrl-C / SIGTERM. :class:`Mesh` is also what the integration tests drive.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

import yaml

from skymesh.config import ConfigError, MeshConfig, load_config
from skymesh.latency_proxy import DelayProxy, proxies_for
from skymesh.procs import Child, skymesh_cmd, wait_healthy


class Mesh:
    def __init__(self, config_path: Path, state_dir: Path, time_scale: float | None = None) -> None:
        self.config_path = config_path
        self.cfg: MeshConfig = load_config(config_path)
        self.state_dir = state_dir
        self.log_dir = state_dir / "logs"
        self.time_scale = time_scale
        self.replicas: dict[str, Child] = {}
        self.balancers: dict[str, Child] = {}
        self.controller: Child | None = None
        self.dns: Child | None = None
        self.proxies: list[DelayProxy] = []

    @classmethod
    def from_dict(cls, data: dict, state_dir: Path, time_scale: float | None = None) -> Mesh:
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / "mesh.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return cls(path, state_dir, time_scale)

    # ------------------------------------------------------------------ parts

    def _replica_child(self, region: str, rid: str) -> Child | None:
        rep = next(x for x in self.cfg.region(region).replicas if x.id == rid)
        if rep.sim is None:
            return None
        ts = self.time_scale if self.time_scale is not None else rep.sim.time_scale
        return Child(f"replica-{rid}", skymesh_cmd(
            "replica-sim", "--host", rep.sim.host, "--port", str(rep.sim.port), "--profile", rep.sim.profile,
            "--time-scale", str(ts), "--model", self.cfg.model), self.log_dir)

    async def start_replicas(self) -> None:
        waits = []
        for r in self.cfg.regions:
            for rep in r.replicas:
                child = self._replica_child(r.name, rep.id)
                if child is not None:
                    child.start()
                    self.replicas[rep.id] = child
                waits.append(wait_healthy(rep.url + "/health", child, within_s=60))
        await asyncio.gather(*waits)

    async def start_dns(self) -> None:
        if self.cfg.dns.provider != "embedded":
            return
        self.dns = Child("dns", skymesh_cmd("dns", "--config", str(self.config_path)), self.log_dir)
        self.dns.start()
        from skymesh.dns.embedded import control_address

        host, port = control_address(self.cfg)
        await wait_healthy(f"http://{host}:{port}/v1/endpoints", self.dns, within_s=30)

    async def start_controller(self) -> None:
        self.controller = Child("controller", skymesh_cmd("controller", "--config", str(self.config_path)),
                                self.log_dir)
        self.controller.start()
        await wait_healthy(self.cfg.controller.http_listen.http_url + "/health", self.controller, within_s=30)

    async def stop_controller(self, kill: bool = False) -> None:
        if self.controller is not None:
            await (self.controller.kill() if kill else self.controller.stop())

    async def start_balancer(self, region: str) -> None:
        child = Child(f"balancer-{region}", skymesh_cmd(
            "balancer", "--config", str(self.config_path), "--region", region), self.log_dir)
        child.start()
        self.balancers[region] = child
        await wait_healthy(self.cfg.region(region).balancer.listen.http_url + "/health", child, within_s=30)

    async def stop_balancer(self, region: str, kill: bool = False) -> None:
        child = self.balancers.get(region)
        if child is not None:
            await (child.kill() if kill else child.stop())

    async def start(self) -> None:
        try:
            if self.cfg.emulate_latency:
                self.proxies = proxies_for(self.cfg)
                for p in self.proxies:
                    await p.start()
            await self.start_replicas()
            await self.start_dns()
            await self.start_controller()
            await asyncio.gather(*(self.start_balancer(r.name) for r in self.cfg.regions))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for child in list(self.balancers.values()):
            await child.stop()
        for child in (self.controller, self.dns):
            if child is not None:
                await child.stop()
        for child in list(self.replicas.values()):
            await child.stop()
        for p in self.proxies:
            await p.stop()

    def describe(self) -> str:
        cfg = self.cfg
        lines = ["skymesh is up.", ""]
        if cfg.dns.provider == "embedded" and cfg.dns.listen:
            lines.append(f"  DNS name     {cfg.dns.name}  (embedded DNS at {cfg.dns.listen}, UDP/TCP)")
        lines.append(f"  controller   {cfg.controller.http_listen.http_url}/v1/status")
        for r in cfg.regions:
            lines.append(f"  {r.name:<14} balancer {r.balancer.advertise_url}  ({len(r.replicas)} replicas)")
        first = cfg.regions[0]
        host = first.balancer.advertise.host
        port = first.balancer.advertise.port
        lines += [
            "",
            "Try:",
            f"  dig @{cfg.dns.listen.host if cfg.dns.listen else '127.0.0.1'} -p "
            f"{cfg.dns.listen.port if cfg.dns.listen else 53} {cfg.dns.name} +subnet=10.2.0.0/16",
            f"  curl -s http://{host}:{port}/v1/completions -H 'Content-Type: application/json' \\",
            f"       -d '{{\"model\": \"{cfg.model}\", \"prompt\": \"hello mesh\", \"max_tokens\": 8}}'",
            "  .venv/bin/skymesh status",
            "",
            f"Logs: {self.log_dir}/   Ctrl-C stops everything.",
        ]
        return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local 3-region mesh)")
    p.add_argument("--time-scale", type=float, default=None, help="override every sim replica's time scale")
    p.add_argument("--state-dir", default=".skymesh/run", help="logs and generated files")


def _config_path(args: argparse.Namespace) -> Path:
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    if args.config is not None:
        return Path(args.config)
    from importlib import resources

    path = state_dir / "local.yaml"
    path.write_text(resources.files("skymesh").joinpath("local.yaml").read_text())
    return path


async def _up(args: argparse.Namespace, path: Path) -> int:
    state_dir = Path(args.state_dir)
    mesh = Mesh(path, state_dir, args.time_scale)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"starting the mesh from {path} ...", flush=True)
    start = asyncio.create_task(mesh.start())
    done, _ = await asyncio.wait({start, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if start not in done:
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await start
        await mesh.stop()
        return 130
    try:
        start.result()
    except (RuntimeError, TimeoutError) as e:
        print(f"the mesh did not come up: {e}", file=sys.stderr)
        return 1
    print(mesh.describe(), flush=True)
    try:
        await stop.wait()
    finally:
        print("stopping ...", flush=True)
        await mesh.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    from skymesh.logging_setup import setup_logging

    setup_logging("WARNING")
    try:
        load_config(args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_up(args, _config_path(args)))


