"""A fleet that forms where an Auto Scaling group starts it: three balancer processes from
one config that lists none of them (``balancer.fleet: registered``), each naming itself
(a flag, environment variables, a stand-in of EC2's instance metadata service) at its own
loopback address, found by each other through the controller's topology; KV events reach
every member; a forged sibling id or epoch is refused and counted; SIGTERM of one leaves
the region in DNS and hands its push-budget units to the others.

Real processes on loopback (stand-in replicas, balancers), the controller in this process
with a DNS provider that records what it is told."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from controller.service import ControllerService
from skymesh.config import MeshConfig, parse_config
from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from skymesh.runtime.procs import Child, free_port, skymesh_cmd, wait_all_ready
from tests.mesh_helpers import admin_auth
from tests.test_fleet import RecordingDns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

US = "us-east-1"
TOKENIZER = "pkg:skymesh/assets/tokenizer/tokenizer.json"
INSTANCE_ID = "i-0123456789abcdef0"
# generous: only a hang guard on a busy 2-core machine
WITHIN_S = 90.0


async def eventually(pred: Callable[[], Awaitable[bool]], what: str, within_s: float = WITHIN_S) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {within_s}s: {what}")


class FakeImds:
    """EC2's instance metadata service, IMDSv2 only (a GET without the session token is
    refused, as on an instance with http_tokens = required), on loopback."""

    def __init__(self, instance_id: str, local_ipv4: str) -> None:
        self.values = {"instance-id": instance_id, "local-ipv4": local_ipv4}
        self.token = "imds-session-token"
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.unauthorized = 0

    async def start(self) -> str:
        async def token(request: web.Request) -> web.Response:
            if "X-aws-ec2-metadata-token-ttl-seconds" not in request.headers:
                return web.Response(status=400)
            return web.Response(text=self.token)

        async def item(request: web.Request) -> web.Response:
            if request.headers.get("X-aws-ec2-metadata-token") != self.token:
                self.unauthorized += 1
                return web.Response(status=401)
            value = self.values.get(request.match_info["item"])
            return web.Response(status=404) if value is None else web.Response(text=value)

        app = web.Application()
        app.router.add_put("/latest/api/token", token)
        app.router.add_get("/latest/meta-data/{item}", item)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def asg_config(tmp_path: Path) -> dict[str, Any]:
    """One region whose balancers register themselves: the config names the listeners every
    instance uses (overridden per process here, as each has its own loopback address) and
    the region's entry, never a balancer."""
    replicas = []
    for i in range(2):
        replicas.append({"id": f"use1-r{i}", "sim": {
            "profile": "tiny-test", "port": free_port(), "tokenizer": TOKENIZER,
            "kv_events": {"port": free_port(), "replay_port": free_port()}}})
    return {
        "model": "skymesh-sim",
        "tokenizer": {"path": TOKENIZER},
        "regions": [{
            "name": US, "source_networks": ["127.1.0.0/16"],
            "balancer": {"listen": "127.0.0.1:8000", "grpc_listen": "127.0.0.1:9000",
                         # the region's entry (an NLB on AWS): nothing here dials it
                         "advertise": f"127.0.0.9:{free_port('127.0.0.9')}",
                         "grpc_advertise": f"127.0.0.9:{free_port('127.0.0.9')}",
                         "fleet": "registered"},
            "replicas": replicas,
        }],
        "controller": {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}",
                       "state_path": str(tmp_path / "controller.sqlite"), "probe_interval_s": 0.5,
                       "failure_threshold": 3},
        "dns": {"name": "llm.skymesh.local", "listen": f"127.0.0.1:{free_port(span=2)}", "ttl_s": 1},
        "policy": {"name": "dualmap", "ttft_slo_s": 5.0, "probe_interval_s": 0.1},
        "offload": {"enabled": False},
        "siblings": {"keepalive_s": 0.25, "miss_limit": 8},
    }


@dataclass
class Member:
    name: str  # how the test calls it
    host: str  # its own loopback address
    child: Child
    expected_id: str

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.child.port('http')}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.child.port('grpc')}"


@dataclass
class AsgFleet:
    cfg: MeshConfig
    controller: ControllerService
    dns: RecordingDns
    members: dict[str, Member]
    imds: FakeImds


def sim_replica_children(cfg: MeshConfig, log_dir: Path) -> list[Child]:
    out = []
    for rep in cfg.region(US).replicas:
        sim = rep.sim
        assert sim is not None and sim.kv_events is not None
        out.append(Child(rep.id, skymesh_cmd(
            "replica-sim", "--host", "127.0.0.1", "--port", str(sim.port), "--profile", sim.profile,
            "--tokenizer", TOKENIZER, "--kv-events-config", sim.kv_events.vllm_json(), "--log-level", "ERROR"),
            log_dir))
    return out


@contextlib.asynccontextmanager
async def asg_fleet(tmp_path: Path) -> AsyncIterator[AsgFleet]:
    cfg_path = tmp_path / "mesh.yaml"
    data = asg_config(tmp_path)
    cfg_path.write_text(json.dumps(data))  # JSON is YAML
    cfg = parse_config(data)
    imds = FakeImds(INSTANCE_ID, "127.0.0.4")
    imds_url = await imds.start()
    dns = RecordingDns()
    controller = ControllerService(cfg, dns)
    log_dir = tmp_path / "logs"
    replicas = sim_replica_children(cfg, log_dir)
    common = ["balancer", "--config", str(cfg_path), "--region", US, "--http-port", "0", "--grpc-port", "0",
              "--drain-timeout-s", "20", "--log-level", "INFO"]
    off_ec2 = {"AWS_EC2_METADATA_DISABLED": "true"}
    members = {
        # its id on the command line, its address its listener's
        "a": Member("a", "127.0.0.2", Child("balancer-a", skymesh_cmd(
            *common, "--listen-host", "127.0.0.2", "--balancer-id", "asg-a"), log_dir, env=off_ec2), "asg-a"),
        # both from the environment (a unit file's Environment=)
        "b": Member("b", "127.0.0.3", Child("balancer-b", skymesh_cmd(*common, "--listen-host", "127.0.0.3"), log_dir,
                                            env={**off_ec2, "SKYMESH_BALANCER_ID": "asg-b",
                                                 "SKYMESH_ADVERTISE_HOST": "127.0.0.3"}), "asg-b"),
        # an EC2 instance: a wildcard listener, id and address from the metadata service
        # (the wildcard is the config's; on loopback without TLS it listens on its address)
        "c": Member("c", "127.0.0.4", Child("balancer-c", skymesh_cmd(*common, "--listen-host", "127.0.0.4"), log_dir,
                                            env={"AWS_EC2_METADATA_SERVICE_ENDPOINT": imds_url}), INSTANCE_ID),
    }
    started: list[Child] = []
    try:
        # every child is forked before this process runs gRPC itself (the controller): a
        # fork while gRPC's threads run is what gRPC warns about
        for c in [*replicas, *(m.child for m in members.values())]:
            c.start()
            started.append(c)
        await wait_all_ready(replicas, WITHIN_S)
        # the balancers start without a controller (each retries every second)
        await wait_all_ready([m.child for m in members.values()], WITHIN_S)
        await controller.start()
        yield AsgFleet(cfg, controller, dns, members, imds)
    finally:
        await asyncio.gather(*(c.stop(grace_s=30.0) for c in started))
        await controller.stop()
        await imds.stop()


async def admin_status(m: Member) -> dict[str, Any] | None:
    with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        async with aiohttp.ClientSession(headers=admin_auth()) as s, \
                s.get(m.url + "/admin/status", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return dict(await r.json())
    return None


async def metrics_of(m: Member) -> str:
    async with aiohttp.ClientSession(headers=admin_auth()) as s, \
            s.get(m.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
        return await r.text()


def topology_members(svc: ControllerService) -> dict[str, Any]:
    return {m.balancer_id: m for a in svc.topology().balancers if a.region == US for m in a.members}


async def fleet_formed(fleet: AsgFleet, names: list[str]) -> bool:
    """The controller lists exactly these members alive, each at its own address, and each
    of them knows the others as siblings and shares every replica's budget with them."""
    want = {fleet.members[n].expected_id: fleet.members[n] for n in names}
    listed = {bid: m for bid, m in topology_members(fleet.controller).items() if m.alive}
    if set(listed) != set(want):
        return False
    for bid, m in want.items():
        if listed[bid].grpc_address != m.grpc_address or listed[bid].http_url != m.url:
            return False
    statuses = [await admin_status(m) for m in want.values()]
    if any(s is None for s in statuses):
        return False
    for bid, st in zip(want, statuses, strict=True):
        assert st is not None
        if st["balancer_id"] != bid or sorted(st["siblings"]["known"]) != sorted(set(want) - {bid}):
            return False
        if "units_held" not in st["siblings"]:
            return False
    budget = 2
    return all(sum(st["siblings"]["units_held"].get(rep.id, 0) for st in statuses if st is not None) == budget
               for rep in fleet.cfg.region(US).replicas)


async def complete(url: str, prompt: str) -> tuple[int, str]:
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": 4}
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
        await r.read()
        return r.status, r.headers.get("X-Skymesh-Replica", "")


def forged_state(region: str, balancer_id: str, epoch: int) -> Any:
    return mesh_pb2.SiblingState(region=region, balancer_id=balancer_id, epoch=epoch, seq=1)


async def send_forged(address: str, messages: list[Any]) -> None:
    """Open a sibling stream to ``address`` (no TLS on loopback: any local process could),
    send ``messages`` and hang up once the balancer has answered once."""
    async def requests() -> AsyncIterator[Any]:
        for m in messages:
            yield m
        await asyncio.sleep(1.0)

    async with grpc.aio.insecure_channel(address) as ch:
        call = mesh_pb2_grpc.MeshPeerStub(ch).Siblings(requests())
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in call:
                break
        call.cancel()


def dropped(text: str, reason: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'skymesh_sibling_messages_dropped_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


async def test_an_auto_scaling_group_forms_one_fleet_shares_kv_events_refuses_forgeries_and_outlives_a_sigterm(
        tmp_path: Path) -> None:
    async with asg_fleet(tmp_path) as fleet:
        # ---- one fleet in the controller's topology, each member at its own address
        await eventually(lambda: fleet_formed(fleet, ["a", "b", "c"]), "three members, one fleet, budgets split")
        listed = topology_members(fleet.controller)
        assert all(m.instance_epoch > 0 for m in listed.values())
        assert fleet.imds.unauthorized == 0  # IMDSv2: every read carried the session token
        assert fleet.dns.healthy() == {US}

        # ---- KV events reach every member: whichever member placed a request, every
        # member's index heard the batch of the replica that computed it (one batch per
        # request here: each prompt is new), not only of its own placements
        served = set()
        for i, m in enumerate(fleet.members.values()):
            status, replica = await complete(m.url, f"member {m.name} asks question number {i} about fleets " * 8)
            assert status == 200 and replica
            served.add(replica)

        async def events_everywhere() -> bool:
            for m in fleet.members.values():
                st = await admin_status(m)
                if st is None:
                    return False
                kv = st.get("kv_events") or {}
                heard = sum((kv.get(rid) or {}).get("stream", {}).get("batches", 0) for rid in served)
                if heard < len(fleet.members) or any((kv.get(rid) or {}).get("index") is None for rid in served):
                    return False
            return True

        await eventually(events_everywhere, f"KV events of {sorted(served)} at every member")

        # ---- a forged sibling: a known id at an epoch from the future, an id nobody listed
        a, b = fleet.members["a"], fleet.members["b"]
        before = await metrics_of(a)
        real_b_epoch = topology_members(fleet.controller)["asg-b"].instance_epoch
        await send_forged(a.grpc_address, [forged_state(US, "asg-b", 2**62), forged_state(US, "ghost-9", 5),
                                           forged_state(US, "asg-b", real_b_epoch - 1)])

        async def counted() -> bool:
            text = await metrics_of(a)
            return (dropped(text, "wrong_epoch") >= dropped(before, "wrong_epoch") + 2
                    and dropped(text, "unknown_sibling") >= dropped(before, "unknown_sibling") + 1)

        await eventually(counted, "the forged messages counted as dropped")
        # the real asg-b is still heard: a message of it applied at a after the forgery
        # (not shadowed by an epoch from the future)
        forged_at = time.monotonic()

        async def b_still_heard() -> bool:
            st = await admin_status(a)
            ago = None if st is None else st["siblings"]["last_heard_s"].get("asg-b")
            return ago is not None and ago < time.monotonic() - forged_at

        await eventually(b_still_heard, "asg-b's real messages still applied after the forgery")
        assert "skymesh_sibling_streams_refused_total 0.0" in await metrics_of(a)

        # ---- SIGTERM of one member: it deregisters, hands its units off, drains, exits;
        # the region stays in DNS and the other two share every unit
        healthy_calls_before = len(fleet.dns.calls)
        await b.child.stop(grace_s=30.0)
        assert b.child.returncode == 0
        await eventually(lambda: fleet_formed(fleet, ["a", "c"]), "the two left share every unit")
        gone = topology_members(fleet.controller)["asg-b"]
        assert not gone.alive
        assert US in fleet.controller.alive_regions()
        assert all(e.healthy for call in fleet.dns.calls[healthy_calls_before:] for e in call if e.region == US)
        assert fleet.dns.healthy() == {US}
        log = b.child.tail(20000)
        assert "push-budget units handed off" in log, log[-3000:]
        for m in (a, fleet.members["c"]):
            status, _ = await complete(m.url, "after the sigterm")
            assert status == 200
