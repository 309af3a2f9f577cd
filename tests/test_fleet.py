"""A region is a fleet: several active-active balancers behind the region's entry
(config members, `skymesh balancer --member K`, the controller's per-member view)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from controller.service import ControllerService
from skymesh.balancer.main import as_member, member_balancer_id, with_listen_ports
from skymesh.config import (
    BalancerMember,
    HostPort,
    MeshConfig,
    RegionConfig,
    load_config,
    parse_config,
)
from skymesh.dns.base import BalancerEndpoint
from skymesh.operations.latency_proxy import DelayProxy
from skymesh.operations.status import render
from skymesh.operations.up import Mesh
from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from skymesh.runtime.procs import free_port
from tests.mesh_helpers import admin_auth, local_config_free_ports, report_figures
from tests.test_mesh_integration import resolve

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "configs" / "local-fleet.yaml"
US = "us-east-1"
SOURCE = "127.1.0.7"  # a client in us-east-1


def fleet_config() -> MeshConfig:
    return load_config(FLEET)


def test_member_k_listens_on_its_sibling_entry_and_keeps_the_region_entry() -> None:
    cfg = fleet_config()
    b = as_member(cfg, "eu-west-1", 1).region("eu-west-1").balancer
    sib = cfg.region("eu-west-1").balancer.siblings[0]
    assert (b.listen, b.grpc_listen, b.peer_listen) == (sib.listen, sib.grpc_listen, sib.peer_listen)
    entry = cfg.region("eu-west-1").balancer
    assert (b.advertise, b.grpc_advertise, b.peer_advertise) == (entry.advertise, entry.grpc_advertise,
                                                                 entry.peer_advertise)
    # the other regions are untouched; member 0 is the config itself
    assert as_member(cfg, "eu-west-1", 1).region("us-east-1") == cfg.region("us-east-1")
    assert as_member(cfg, "eu-west-1", 0) is cfg
    # the port overrides apply on top of the member's listeners
    moved = with_listen_ports(as_member(cfg, "eu-west-1", 1), "eu-west-1", 0, None).region("eu-west-1").balancer
    assert moved.listen == HostPort(sib.listen.host, 0) and moved.grpc_listen == sib.grpc_listen


def test_a_member_is_named_by_its_id_and_a_lone_balancer_as_before() -> None:
    cfg = fleet_config()
    assert member_balancer_id(cfg, "us-east-1", 1, None) == "us-east-1-b1"
    assert member_balancer_id(cfg, "us-east-1", 0, None) == "us-east-1-b0"
    assert member_balancer_id(cfg, "us-east-1", 1, "mine") == "mine"
    lone = load_config(ROOT / "configs" / "local.yaml")
    assert member_balancer_id(lone, "us-east-1", 0, None) is None  # a fresh id per process


def test_a_member_the_region_does_not_have_is_a_config_error() -> None:
    done = subprocess.run([sys.executable, "-m", "skymesh.cli", "balancer", "--config", str(FLEET),
                           "--region", "us-east-1", "--member", "2"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "has 2 balancer(s)" in done.stderr and "no member 2" in done.stderr


# ----------------------------------------------------------------------------- skymesh up


def one_region_fleet(tmp_path: Path) -> dict[str, Any]:
    """us-east-1 of the local mesh (free ports) with two balancers behind its entry."""
    data = local_config_free_ports(time_scale=1.0, siblings=1)
    data["regions"] = data["regions"][:1]
    for rep in data["regions"][0]["replicas"]:
        rep["sim"]["profile"] = "tiny-test"
    data["latencies"] = []
    data["offload"]["rules"] = []
    data["controller"].update(state_path=str(tmp_path / "controller.sqlite"), probe_interval_s=0.5,
                              failure_threshold=3)
    data["dns"]["ttl_s"] = 1
    return data


@contextlib.asynccontextmanager
async def running_fleet(tmp_path: Path) -> AsyncIterator[Mesh]:
    mesh = Mesh.from_dict(one_region_fleet(tmp_path), tmp_path / "run")
    await mesh.start()
    try:
        yield mesh
    finally:
        await mesh.stop()


async def member_status(member: BalancerMember) -> dict[str, Any] | None:
    with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
        async with aiohttp.ClientSession(headers=admin_auth()) as s, \
                s.get(member.listen.http_url + "/admin/status", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return dict(await r.json())
    return None


async def complete_on_a_new_connection(url: str, source: str, prompt: str, max_tokens: int = 8) -> int:
    """One completion on its own connection (the entry spreads connections, not requests);
    0 when the connection failed or broke."""
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": max_tokens}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(source, 0), force_close=True)) \
                as s, s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            await r.read()
            return r.status
    except (TimeoutError, aiohttp.ClientError, OSError):
        return 0


def http_entry(mesh: Mesh) -> DelayProxy:
    return next(p for p in mesh.proxies if p.region == US and p.kind == "http")


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_up_starts_every_member_behind_one_entry(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as mesh:
        region = mesh.cfg.region(US)
        assert sorted(mesh.balancer_members) == [(US, 0), (US, 1)]
        assert all(c.running() for c in mesh.balancer_members.values())
        statuses = [await member_status(m) for m in region.balancer_members]
        assert [s and s.get("balancer_id") for s in statuses] == [f"{US}-b0", f"{US}-b1"]

        async def siblings_known() -> bool:
            # each member learns the other from the controller's topology
            seen = [await member_status(m) for m in region.balancer_members]
            return all(s is not None and [(x["balancer_id"], x["alive"]) for x in s["siblings"]["members"]]
                       == [(other, True)] for s, other in zip(seen, (f"{US}-b1", f"{US}-b0"), strict=True))

        for _ in range(200):  # hang guard
            if await siblings_known():
                break
            await asyncio.sleep(0.1)
        assert await siblings_known()

        async def budget_split() -> bool:
            # the sibling channel runs: every replica's push budget is held once over the two
            seen = [await member_status(m) for m in region.balancer_members]
            if any(s is None or "units_held" not in s["siblings"] for s in seen):
                return False
            held = [s["siblings"]["units_held"] for s in seen if s is not None]
            return all(sum(h.get(r.id, 0) for h in held) == 2 for r in region.replicas)

        for _ in range(200):  # hang guard
            if await budget_split():
                break
            await asyncio.sleep(0.1)
        assert await budget_split()
        # shared probing: each replica is probed by one member, whose pages the other applies
        seen = [await member_status(m) for m in region.balancer_members]
        owned = [s["siblings"]["probes_owned"] for s in seen if s is not None]
        assert sorted(owned[0] + owned[1]) == sorted(r.id for r in region.replicas), owned

        async def sibling_pages(m: BalancerMember) -> float:
            async with aiohttp.ClientSession(headers=admin_auth()) as s, \
                    s.get(m.listen.http_url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                text = await r.text()
            wanted = 'skymesh_replica_pages_total{source="sibling"}'
            return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted))

        for _ in range(200):  # hang guard
            if all([await sibling_pages(m) > 0 for m in region.balancer_members]):
                break
            await asyncio.sleep(0.1)
        assert all([await sibling_pages(m) > 0 for m in region.balancer_members])
        entry = region.balancer.advertise_url
        by_member = http_entry(mesh).connections_by_target
        members = [(m.listen.host, m.listen.port) for m in region.balancer_members]
        codes = []
        # round robin over the members in service: 6 connections give each 3 on a quiet
        # machine; on a busy one a member whose health check timed out is skipped for a
        # while (as an NLB would), so the spreading is judged over up to 30
        for i in range(30):
            codes.append(await complete_on_a_new_connection(entry, SOURCE, f"hello {i}"))
            if all(by_member[m] >= 3 for m in members):
                break
        assert codes == [200] * len(codes)
        assert all(by_member[m] >= 3 for m in members), by_member
        assert f"{US}" in mesh.describe() and "2 balancers" in mesh.describe()


# ----------------------------------------------------------------------------- the controller


class HealthOnly:
    """A balancer stand-in that only answers /health, on one member's listener."""

    def __init__(self, listen: HostPort) -> None:
        self.listen = listen
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.listen.host, self.listen.port, reuse_address=True).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class RecordingDns:
    """A DNS provider that keeps every endpoint list it was told."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[list[BalancerEndpoint]] = []

    async def sync(self, endpoints: list[BalancerEndpoint]) -> bool:
        changed = not self.calls or self.calls[-1] != endpoints
        self.calls.append(list(endpoints))
        return changed

    async def close(self) -> None:
        return None

    def healthy(self) -> set[str]:
        return {e.region for e in self.calls[-1] if e.healthy} if self.calls else set()


def controller_fleet_config(tmp_path: Path) -> MeshConfig:
    data = local_config_free_ports(siblings=1)
    data["emulate_latency"] = False
    data["controller"].update(state_path=str(tmp_path / "controller.sqlite"), probe_interval_s=0.2,
                              failure_threshold=2)
    return parse_config(data)


async def eventually(pred: Callable[[], bool], what: str) -> None:
    """Wait for ``pred``; the bound is only a hang guard."""
    for _ in range(600):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


@contextlib.asynccontextmanager
async def fleet_controller(cfg: MeshConfig, dns: RecordingDns | None = None) -> AsyncIterator[
        tuple[ControllerService, Any, dict[str, HealthOnly]]]:
    """A started controller, a stub to it, and a /health answerer on every member's listener."""
    answering = {m.id: HealthOnly(m.listen) for r in cfg.regions for m in r.balancer_members}
    svc = ControllerService(cfg, dns)
    try:
        for h in answering.values():
            await h.start()
        await svc.start()
        async with grpc.aio.insecure_channel(str(cfg.controller.listen)) as ch:
            yield svc, mesh_pb2_grpc.ControllerStub(ch), answering
    finally:
        await svc.stop()
        for h in answering.values():
            await h.stop()


def register(region: RegionConfig, member: int) -> Any:
    m = region.balancer_members[member]
    return mesh_pb2.RegisterRequest(region=region.name, balancer_id=m.id, member_grpc_address=str(m.grpc_listen))


def members_of(topology: Any, region: str) -> dict[str, Any]:
    return {m.balancer_id: m for a in topology.balancers if a.region == region for m in a.members}


async def test_a_region_lives_while_any_balancer_does_and_fails_over_with_the_last(tmp_path: Path) -> None:
    cfg = controller_fleet_config(tmp_path)
    use1 = cfg.region(US)
    dns = RecordingDns()
    async with fleet_controller(cfg, dns) as (svc, stub, answering):
        b0 = await stub.Register(register(use1, 0), timeout=5)
        b1 = await stub.Register(register(use1, 1), timeout=5)
        # each registration its own epoch, never one another's
        assert b0.accepted and b1.accepted and b1.epoch > b0.epoch
        members = members_of(b1.topology, US)
        assert set(members) == {f"{US}-b0", f"{US}-b1"}
        for m in use1.balancer_members:
            listed = members[m.id]
            assert listed.alive and listed.http_url == m.listen.http_url
            assert listed.grpc_address == str(m.grpc_listen)
        assert (members[f"{US}-b0"].epoch, members[f"{US}-b1"].epoch) == (b0.epoch, b1.epoch)
        await eventually(lambda: dns.healthy() == {r.name for r in cfg.regions}, "DNS told every region is up")
        owners_before = dict(svc.owners)

        # one balancer drains and leaves: its region stays, DNS and ownership do not move
        v0 = svc.version
        left = await stub.Deregister(mesh_pb2.DeregisterRequest(
            region=US, balancer_id=f"{US}-b1", epoch=b1.epoch, reason="draining"), timeout=5)
        assert left.accepted and left.topology_version > v0  # the siblings hear of it
        assert US in svc.alive_regions() and svc.owners == owners_before
        after = members_of(svc.topology(), US)
        assert not after[f"{US}-b1"].alive and after[f"{US}-b0"].alive
        # its /health still answers while it drains: probes do not bring it back
        await asyncio.sleep(4 * cfg.controller.probe_interval_s)
        assert not members_of(svc.topology(), US)[f"{US}-b1"].alive
        assert dns.healthy() == {r.name for r in cfg.regions}
        st = await stub.GetStatus(mesh_pb2.StatusRequest(), timeout=5)
        rs = {r.region: r for r in st.regions}[US]
        assert rs.balancer_alive and [(m.balancer_id, m.alive) for m in rs.members] == [
            (f"{US}-b0", True), (f"{US}-b1", False)]
        text = render(svc.status_json())
        assert f"== {US}  1/2 balancers up" in text and f"{US}-b1" in text
        exposition = svc.metrics.render().decode().splitlines()
        assert f'skymesh_controller_balancers{{region="{US}"}} 2.0' in exposition
        assert f'skymesh_controller_balancers_alive{{region="{US}"}} 1.0' in exposition

        # the last one dies (its /health stops answering): failover as for a lone balancer
        await answering[f"{US}-b0"].stop()
        await eventually(lambda: US not in svc.alive_regions(), "us-east-1 dead with its last balancer")
        use1_replicas = {rep.id for rep in use1.replicas}
        assert {rid for rid, owner in svc.owners.items() if owner == "eu-west-1"} >= use1_replicas
        await eventually(lambda: US not in dns.healthy(), "DNS told us-east-1 is out")
        # a balancer of it comes back: so does the region
        await stub.Register(register(use1, 1), timeout=5)
        assert US in svc.alive_regions() and svc.owners == owners_before


async def test_a_silent_member_dies_alone_and_epochs_survive_a_restart(tmp_path: Path) -> None:
    cfg = controller_fleet_config(tmp_path)
    eu = cfg.region("eu-west-1")
    async with fleet_controller(cfg) as (svc, stub, answering):
        first = await stub.Register(register(eu, 0), timeout=5)
        second = await stub.Register(register(eu, 1), timeout=5)
        await answering["eu-west-1-b1"].stop()  # killed: no deregistration
        await eventually(lambda: not members_of(svc.topology(), "eu-west-1")["eu-west-1-b1"].alive,
                         "the silent balancer declared dead")
        assert "eu-west-1" in svc.alive_regions()
        assert members_of(svc.topology(), "eu-west-1")["eu-west-1-b0"].alive
        # a stale registration of the other member cannot deregister this one
        stale = await stub.Deregister(mesh_pb2.DeregisterRequest(
            region="eu-west-1", balancer_id="eu-west-1-b0", epoch=second.epoch), timeout=5)
        assert not stale.accepted and "eu-west-1" in svc.alive_regions()
    async with fleet_controller(cfg) as (svc, stub, _):
        # the state file kept each member: its epoch never repeats, the dead one is known dead
        recovered = members_of(svc.topology(), "eu-west-1")
        assert recovered["eu-west-1-b0"].epoch == first.epoch and recovered["eu-west-1-b1"].epoch == second.epoch
        again = await stub.Register(register(eu, 0), timeout=5)
        assert again.epoch > second.epoch


# ----------------------------------------------------------------------------- a member killed


async def stream_on_a_new_connection(url: str, source: tuple[str, int], prompt: str,
                                     max_tokens: int) -> dict[str, Any]:
    """One streamed completion on its own connection from ``source`` (ip, port): its
    status (0: the connection failed or broke) and whether the stream ended with [DONE]."""
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=source, force_close=True)) \
                as s, s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            data = await r.read()
            return {"status": r.status, "done": b"[DONE]" in data}
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return {"status": 0, "done": False, "error": type(e).__name__}


async def controller_status(mesh: Mesh) -> dict[str, Any] | None:
    url = mesh.cfg.controller.http_listen.http_url + "/v1/status"
    with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
        async with aiohttp.ClientSession(headers=admin_auth()) as s, \
                s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return dict(await r.json())
    return None


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.timeout(240)
async def test_a_killed_member_fails_only_its_open_streams_and_its_sibling_serves_the_rest(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as mesh:
        region = mesh.cfg.region(US)
        entry = http_entry(mesh)
        victim = region.balancer_members[1]
        victim_target = (victim.listen.host, victim.listen.port)
        address = region.balancer.advertise.host
        assert await asyncio.to_thread(resolve, mesh, SOURCE) == address
        killed = asyncio.Event()
        may_start = asyncio.Event()  # cleared while the member is killed: the set in flight is known
        may_start.set()
        in_flight: set[tuple[str, int]] = set()  # the client addresses of the requests in flight
        results: list[tuple[tuple[str, int], bool, dict[str, Any]]] = []  # (client, started after the kill, result)

        async def user(k: int, n: int) -> None:
            for i in range(n):
                await may_start.wait()
                client = (SOURCE, free_port(SOURCE))
                after = killed.is_set()
                in_flight.add(client)
                try:
                    res = await stream_on_a_new_connection(region.balancer.advertise_url, client,
                                                           f"user {k} asks {i}", max_tokens=48)
                finally:
                    in_flight.discard(client)
                results.append((client, after, res))

        def carries_again(target: tuple[str, int], count: int, carried: int) -> bool:
            return len(results) >= count + 8 and entry.connections_by_target[target] > carried

        load = asyncio.gather(*(user(k, 12) for k in range(4)))
        await eventually(lambda: entry.open_connections_to(victim_target) >= 1 and len(results) >= 4,
                         "requests streaming through both members")
        may_start.clear()
        # every request in flight has its connection to a member: who carries which is known
        await eventually(lambda: in_flight <= {c for c, _ in entry.open_connections()},
                         "the requests in flight connected")
        on_victim = {c for c, target in entry.open_connections() if target == victim_target}
        carried_before = entry.connections_by_target[victim_target]
        await mesh.stop_balancer(US, kill=True, member=1)  # SIGKILL
        killed.set()
        may_start.set()
        await load

        failed = [(client, res) for client, _, res in results if not (res["status"] == 200 and res["done"])]
        # only what it was streaming failed ...
        assert all(client in on_victim for client, _ in failed), (failed, on_victim)
        # ... every request that started after the kill was served, by the sibling
        after = [res for _, started_after, res in results if started_after]
        assert after and all(res["status"] == 200 and res["done"] for res in after), after
        assert entry.connections_by_target[victim_target] == carried_before
        # the controller sees one balancer gone, the region alive: DNS does not move
        def b1_dead(st: dict[str, Any] | None) -> bool:
            if st is None:
                return False
            us = next(r for r in st["regions"] if r["region"] == US)
            return us["balancer_alive"] and [m["alive"] for m in us["balancers"]] == [True, False]

        for _ in range(300):  # hang guard
            if b1_dead(await controller_status(mesh)):
                break
            await asyncio.sleep(0.1)
        assert b1_dead(await controller_status(mesh))
        assert await asyncio.to_thread(resolve, mesh, SOURCE) == address
        report_figures("fleet_member_killed", requests=len(results), failed=len(failed),
                       open_on_killed_member=len(on_victim), started_after_kill=len(after))


def test_up_checks_every_members_listeners_before_starting(tmp_path: Path) -> None:
    mesh = Mesh(FLEET, tmp_path)
    listed = {(what, f"{host}:{port}") for what, host, port, _udp in mesh.listen_addresses()}
    for r in mesh.cfg.regions:
        for m in r.balancer_members:
            assert (f"balancer {m.id} HTTP", str(m.listen)) in listed
            assert (f"balancer {m.id} gRPC", str(m.grpc_listen)) in listed
            assert (f"balancer {m.id} peer listener", str(m.peer_listen)) in listed
        assert (f"delay proxy {r.name} HTTP", str(r.balancer.advertise)) in listed
    assert "2 balancers" in mesh.describe()


async def test_both_balancers_leaving_fails_the_region_over_as_one_did(tmp_path: Path) -> None:
    cfg = controller_fleet_config(tmp_path)
    eu = cfg.region("eu-west-1")
    dns = RecordingDns()
    async with fleet_controller(cfg, dns) as (svc, stub, _):
        regs = [await stub.Register(register(eu, k), timeout=5) for k in (0, 1)]
        await eventually(lambda: dns.healthy() == {r.name for r in cfg.regions}, "DNS told every region is up")
        first = await stub.Deregister(mesh_pb2.DeregisterRequest(
            region="eu-west-1", balancer_id="eu-west-1-b0", epoch=regs[0].epoch), timeout=5)
        assert first.accepted and "eu-west-1" in svc.alive_regions()
        last = await stub.Deregister(mesh_pb2.DeregisterRequest(
            region="eu-west-1", balancer_id="eu-west-1-b1", epoch=regs[1].epoch), timeout=5)
        assert last.accepted and "eu-west-1" not in svc.alive_regions()
        # at once, as a lone balancer's deregistration: its replicas to the nearest live region
        assert {svc.owners[rep.id] for rep in eu.replicas} == {"us-east-1"}
        await eventually(lambda: dns.healthy() == {"us-east-1", "ap-northeast-1"}, "DNS told eu-west-1 is out")
        assert svc.status_json()["regions"][1]["balancer_draining"]


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.timeout(240)
async def test_a_draining_member_deregisters_alone_and_the_region_keeps_serving(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as mesh:
        region = mesh.cfg.region(US)

        def members_state(st: dict[str, Any] | None) -> list[tuple[bool, bool]] | None:
            if st is None:
                return None
            us = next(r for r in st["regions"] if r["region"] == US)
            return [(m["alive"], m["draining"]) for m in us["balancers"]] if us["balancer_alive"] else None

        async def wait_members(expected: list[tuple[bool, bool]], what: str) -> None:
            for _ in range(300):  # hang guard
                if members_state(await controller_status(mesh)) == expected:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"never: {what} (last: {members_state(await controller_status(mesh))})")

        await wait_members([(True, False), (True, False)], "both members registered and alive")
        await mesh.stop_balancer(US, member=1)  # SIGTERM: deregister, drain, exit
        assert not mesh.balancer_members[(US, 1)].running()
        await wait_members([(True, False), (False, True)], "the drained member out, the region alive")
        assert await asyncio.to_thread(resolve, mesh, SOURCE) == region.balancer.advertise.host
        codes = [await complete_on_a_new_connection(region.balancer.advertise_url, SOURCE, f"after {i}")
                 for i in range(4)]
        assert codes == [200] * 4
        # it comes back: registered again, alive again
        await mesh.start_balancer(US, member=1)
        await wait_members([(True, False), (True, False)], "the restarted member back")


# ----------------------------------------------------------------------------- a rolling restart


async def one_completion(session: aiohttp.ClientSession, url: str, prompt: str, stream: bool) -> dict[str, Any]:
    """One completion on ``session`` (whatever connection it picks): its status (0: the
    connection failed or broke) and whether the answer is complete ([DONE] for a stream,
    a choice with text otherwise)."""
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": 64 if stream else 16, "stream": stream}
    try:
        async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            data = await r.read()
            if r.status != 200:
                return {"status": r.status, "complete": False, "body": data[:200].decode(errors="replace")}
            if stream:
                return {"status": 200, "complete": data.rstrip().endswith(b"data: [DONE]")}
            choices = (await r.json()).get("choices") or [{}]
            return {"status": 200, "complete": bool(choices[0].get("text"))}
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        return {"status": 0, "complete": False, "error": type(e).__name__}


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.timeout(420)
async def test_a_rolling_restart_of_the_region_loses_no_request(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as mesh:
        region = mesh.cfg.region(US)
        entry = http_entry(mesh)
        url = region.balancer.advertise_url

        def alive_members(st: dict[str, Any] | None) -> list[bool] | None:
            if st is None:
                return None
            us = next(r for r in st["regions"] if r["region"] == US)
            return [m["alive"] and not m["draining"] for m in us["balancers"]]

        async def both_alive() -> None:
            for _ in range(300):  # hang guard
                if alive_members(await controller_status(mesh)) == [True, True]:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"never both alive: {alive_members(await controller_status(mesh))}")

        await both_alive()
        stop = asyncio.Event()
        results: list[tuple[str, dict[str, Any]]] = []  # (user, result)

        async def new_connection_user(k: int) -> None:
            i = 0
            while not stop.is_set():
                connector = aiohttp.TCPConnector(local_addr=(SOURCE, 0), force_close=True)
                async with aiohttp.ClientSession(connector=connector) as s:
                    results.append((f"user {k}", await one_completion(s, url, f"user {k} asks {i}", i % 2 == 0)))
                i += 1
                await asyncio.sleep(0.05)

        async def keep_alive_user() -> None:
            i = 0
            connector = aiohttp.TCPConnector(local_addr=(SOURCE, 0), limit=1)
            async with aiohttp.ClientSession(connector=connector) as s:
                while not stop.is_set():
                    results.append(("keep-alive", await one_completion(s, url, f"session asks {i}", i % 2 == 1)))
                    i += 1
                    await asyncio.sleep(0.05)

        def carries_again(target: tuple[str, int], count: int, carried: int) -> bool:
            return len(results) >= count + 8 and entry.connections_by_target[target] > carried

        load = asyncio.gather(*(new_connection_user(k) for k in range(3)), keep_alive_user())
        try:
            await eventually(lambda: len(results) >= 8, "the load running")
            carried_after_restart: dict[tuple[str, int], int] = {}
            open_at_sigterm: list[int] = []  # connections each member carried when it was told to stop
            for k, member in enumerate(region.balancer_members):
                target = (member.listen.host, member.listen.port)
                # SIGTERM while it carries requests: those must finish, not break
                await eventually(lambda: entry.open_connections_to(target) >= 2,  # noqa: B023 (awaited here)
                                 f"requests in flight on {member.id}")
                open_at_sigterm.append(entry.open_connections_to(target))
                await mesh.stop_balancer(US, member=k)  # SIGTERM: deregister, drain, exit
                assert not mesh.balancer_members[(US, k)].running()
                assert mesh.balancer_members[(US, k)].returncode == 0
                await mesh.start_balancer(US, member=k)  # ready on return
                await both_alive()
                carried_after_restart[target] = entry.connections_by_target[target]
                await eventually(partial(carries_again, target, len(results), entry.connections_by_target[target]),
                                 f"the restarted {member.id} carrying connections again")
        finally:
            stop.set()
            await load
        failed = [(who, res) for who, res in results if not (res["status"] == 200 and res["complete"])]
        assert not failed, failed
        keep_alive = [res for who, res in results if who == "keep-alive"]
        assert len(keep_alive) >= 4
        # each member carried connections again after its restart
        grown = {t: entry.connections_by_target[t] - n for t, n in carried_after_restart.items()}
        assert all(g >= 1 for g in grown.values()), grown
        report_figures("fleet_rolling_restart", requests=len(results), failed=len(failed),
                       keep_alive_requests=len(keep_alive), open_at_sigterm=open_at_sigterm,
                       connections_after_restart={f"{h}:{p}": g for (h, p), g in grown.items()})


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.timeout(240)
async def test_a_draining_member_answers_a_kept_alive_connection_with_connection_close(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as mesh:
        member = mesh.cfg.region(US).balancer_members[1]
        url = member.listen.http_url
        child = mesh.balancer_members[(US, 1)]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(SOURCE, 0), limit=2)) as s:
            # a long stream on one connection keeps the member draining; a second connection
            # stays open and idle in the session's pool
            long_stream = asyncio.create_task(one_completion_of(s, url, "a long one", 3000))
            first = await one_completion(s, url, "first", stream=False)
            assert first["status"] == 200 and first["complete"]
            assert not long_stream.done()
            assert child.running()
            child.signal_group(signal.SIGTERM)  # drain: the listener closes, the stream goes on

            async def refused() -> bool:
                with contextlib.suppress(OSError):
                    _, w = await asyncio.open_connection(member.listen.host, member.listen.port)
                    w.close()
                    return False
                return True

            for _ in range(300):  # hang guard
                if await refused():
                    break
                await asyncio.sleep(0.02)
            assert await refused()
            assert not long_stream.done()
            # the next request on the session reuses the idle kept-alive connection: served,
            # and told to close it, so the session's next connection goes elsewhere
            body = {"model": "skymesh-sim", "prompt": "during the drain", "max_tokens": 8}
            async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
                during = (r.status, r.headers.get("Connection", "").lower(), bool((await r.json())["choices"][0]["text"]))
            assert during == (200, "close", True), during
            assert await long_stream == {"status": 200, "complete": True}
        if child.proc is not None:
            await asyncio.to_thread(child.proc.wait)  # the drain ends with the stream
        assert child.returncode == 0


async def one_completion_of(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A stream of ``max_tokens`` on ``session``: its status and whether it ended with [DONE]."""
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        data = await r.read()
        return {"status": r.status, "complete": data.rstrip().endswith(b"data: [DONE]")}


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.timeout(240)
async def test_a_frozen_member_is_taken_out_of_the_entry_on_the_controllers_word(tmp_path: Path) -> None:
    """SIGSTOP one of two members: it keeps its listener (the kernel still completes
    connections nobody answers). Once the controller lists it dead (its siblings' reports
    or its probes), the entry sends it no new connection, whatever its own checks say yet;
    every request through the entry from then on is served by the sibling."""
    async with running_fleet(tmp_path) as mesh:
        region = mesh.cfg.region(US)
        entry = http_entry(mesh)
        assert entry.health is not None and entry.health.controller is not None
        frozen = region.balancer_members[1]
        frozen_health = frozen.listen.http_url + "/health"
        frozen_target = (frozen.listen.host, frozen.listen.port)
        child = mesh.balancer_members[(US, 1)]
        # both members serve through the entry first
        codes = [await complete_on_a_new_connection(region.balancer.advertise_url, SOURCE, f"warm {i}")
                 for i in range(4)]
        assert codes == [200] * 4
        child.signal_group(signal.SIGSTOP)
        try:
            def listed_dead() -> bool:
                assert entry.health is not None
                return frozen_health in entry.health.listed_dead

            await eventually(listed_dead, "the entry reads the controller's word on the frozen member")
            carried = entry.connections_by_target[frozen_target]
            codes = [await complete_on_a_new_connection(region.balancer.advertise_url, SOURCE, f"after {i}")
                     for i in range(6)]
            # what the entry knew (a failure says whether the frozen member was back in service)
            seen = (entry.health.listed_dead, entry.health.healthy, dict(entry.connections_by_target), carried)
            assert codes == [200] * 6, (codes, seen)
            assert entry.connections_by_target[frozen_target] == carried, seen
        finally:
            child.signal_group(signal.SIGCONT)
