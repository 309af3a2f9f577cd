"""A member's identity without the config listing it: where its id and reachable address
come from (flag, environment, EC2's instance metadata service over IMDSv2 against a
loopback stand-in), how the controller matches registrations (by id, never folding two
instances onto one member, never publishing a wildcard), who may speak as a sibling, and
a replica's drain in a fleet (it ends only when every live member reports it idle)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.service import ControllerService
from skymesh.balancer.fleet import RegionFleet
from skymesh.balancer.identity import InstanceMetadata, read_imds, resolve_identity
from skymesh.balancer.main import with_listen_ports
from skymesh.config import ConfigError, MeshConfig, parse_config
from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from skymesh.routing.assembly import SiblingSettings
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.region import RegionCore
from skymesh.routing.registry import make_policy
from skymesh.runtime.procs import free_port
from tests.test_fleet import RecordingDns
from tests.test_fleet_asg import FakeImds

US = "us-east-1"
# what terraform's config module renders for a registered fleet's listeners: config text
# these tests parse and check is never advertised or dialled (nothing here binds it)
RENDERED_WILDCARD = ".".join(["0"] * 4)


def registered_fleet(tmp_path: Path, listen_host: str = RENDERED_WILDCARD, **controller: Any) -> dict[str, Any]:
    return {
        "model": "skymesh-sim",
        "regions": [{
            "name": US, "source_networks": ["127.1.0.0/16"],
            "balancer": {"listen": f"{listen_host}:8000", "grpc_listen": f"{listen_host}:9000",
                         "advertise": "127.0.0.9:8000", "grpc_advertise": "127.0.0.9:9000", "fleet": "registered"},
            "replicas": [{"id": "r0", "url": "http://127.0.0.1:1"}],
        }],
        "controller": {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}",
                       "state_path": str(tmp_path / "controller.sqlite"), "probe_interval_s": 0.2,
                       "failure_threshold": 2, **controller},
        "dns": {"name": "llm.skymesh.local", "listen": f"127.0.0.1:{free_port(span=2)}"},
        "offload": {"enabled": False},
        "membership": {"registration": {"enabled": True}, "drain_grace_s": 600},
    }


# ----------------------------------------------------------------------------- identity


def no_imds(_endpoint: str) -> InstanceMetadata | None:
    raise AssertionError("the metadata service must not be asked")


def test_flag_beats_environment_beats_the_metadata_service(tmp_path: Path) -> None:
    cfg = parse_config(registered_fleet(tmp_path))
    ec2 = InstanceMetadata("i-0abc12345678", "10.0.1.7")
    both = resolve_identity(cfg, US, 0, listen_host=RENDERED_WILDCARD, balancer_id="mine", advertise_host="10.9.9.9",
                            environ={"SKYMESH_BALANCER_ID": "env-id", "SKYMESH_ADVERTISE_HOST": "10.8.8.8"},
                            imds=no_imds)
    assert (both.balancer_id, both.advertise_host, both.id_source, both.host_source) == (
        "mine", "10.9.9.9", "flag", "flag")
    env = resolve_identity(cfg, US, 0, listen_host=RENDERED_WILDCARD,
                           environ={"SKYMESH_BALANCER_ID": "env-id", "SKYMESH_ADVERTISE_HOST": "10.8.8.8"},
                           imds=no_imds)
    assert (env.balancer_id, env.advertise_host) == ("env-id", "10.8.8.8")
    asked: list[str] = []

    def imds(endpoint: str) -> InstanceMetadata:
        asked.append(endpoint)
        return ec2

    on_ec2 = resolve_identity(cfg, US, 0, listen_host=RENDERED_WILDCARD, environ={}, imds=imds)
    assert (on_ec2.balancer_id, on_ec2.advertise_host, on_ec2.id_source) == ("i-0abc12345678", "10.0.1.7", "imds")
    assert asked == ["http://169.254.169.254"]  # once, at EC2's address
    # a specific listen host is its own address: only the id comes from EC2
    specific = resolve_identity(cfg, US, 0, listen_host="10.0.1.8", environ={}, imds=imds)
    assert (specific.balancer_id, specific.advertise_host) == ("i-0abc12345678", None)
    # turned off, or off EC2: a fresh id per process and no address (never the wildcard)
    off = resolve_identity(cfg, US, 0, listen_host=RENDERED_WILDCARD, environ={"AWS_EC2_METADATA_DISABLED": "true"},
                           imds=no_imds)
    assert (off.balancer_id, off.advertise_host) == (None, None)
    with pytest.raises(ValueError, match="wildcard"):
        resolve_identity(cfg, US, 0, listen_host=RENDERED_WILDCARD, advertise_host=RENDERED_WILDCARD, environ={}, imds=no_imds)
    with pytest.raises(ValueError, match="letters"):
        resolve_identity(cfg, US, 0, listen_host=RENDERED_WILDCARD, balancer_id="a b", environ={}, imds=no_imds)


def test_a_listed_member_keeps_its_config_id_and_never_asks_ec2(tmp_path: Path) -> None:
    from tests.mesh_helpers import local_config_free_ports

    cfg = parse_config(local_config_free_ports(siblings=1))
    got = resolve_identity(cfg, US, 1, listen_host="127.0.0.1", environ={}, imds=no_imds)
    assert (got.balancer_id, got.id_source) == (f"{US}-b1", "config")


async def test_imdsv2_is_read_with_a_session_token_and_a_dead_endpoint_fails_fast() -> None:
    imds = FakeImds("i-0123456789abcdef0", "127.0.0.4")
    url = await imds.start()
    try:
        got = await asyncio.to_thread(read_imds, url)
        assert got == InstanceMetadata("i-0123456789abcdef0", "127.0.0.4")
        assert imds.unauthorized == 0
        imds.values["local-ipv4"] = "not an address"
        imds.values["instance-id"] = "../../etc"
        assert await asyncio.to_thread(read_imds, url) == InstanceMetadata(None, None)
    finally:
        await imds.stop()
    # nothing listens there any more: None, not an exception, within the short timeout
    assert await asyncio.to_thread(read_imds, url) is None


def test_a_registered_fleet_lists_no_balancer_and_needs_an_entry(tmp_path: Path) -> None:
    data = registered_fleet(tmp_path)
    data["regions"][0]["balancer"]["siblings"] = [{"listen": "127.0.0.1:1", "grpc_listen": "127.0.0.1:2"}]
    with pytest.raises(ConfigError, match="registered fleet lists no balancer"):
        parse_config(data)
    data = registered_fleet(tmp_path, listen_host="127.0.0.1")
    data["regions"][0]["balancer"].update(advertise="127.0.0.1:8000")
    with pytest.raises(ConfigError, match="entry address"):
        parse_config(data)
    cfg = with_listen_ports(parse_config(registered_fleet(tmp_path)), US, 0, 0, host="127.0.0.3")
    b = cfg.region(US).balancer
    assert (str(b.listen), str(b.grpc_listen), str(b.advertise)) == ("127.0.0.3:0", "127.0.0.3:0", "127.0.0.9:8000")


# ----------------------------------------------------------------------------- who is a sibling


class _Member:
    def __init__(self, balancer_id: str, alive: bool, instance_epoch: int, grpc_address: str) -> None:
        self.balancer_id, self.alive, self.epoch = balancer_id, alive, 1
        self.instance_epoch, self.grpc_address, self.http_url = instance_epoch, grpc_address, ""


def test_sibling_ids_and_epochs_come_from_the_topology_and_wildcards_are_never_dialled() -> None:
    now = [100.0]
    core = RegionCore(US, make_policy("round_robin"), OffloadRouter(US, {}))
    fleet = RegionFleet(US, "me", 7, core, static_members={"listed": f"{RENDERED_WILDCARD}:9000", "other": "127.0.0.5:9"},
                        settings=SiblingSettings(dead_after_s=1.0, page_lag_s=0.25, lease_s=1.0, clock_skew_s=0.25,
                                                 want_memory_s=0.25),
                        clock=lambda: now[0])
    # the config's list before any topology: its ids, never its wildcard address
    assert fleet.addresses() == {"other": "127.0.0.5:9"}
    assert fleet.refusal("listed", 1) is None and fleet.refusal("ghost", 1) == "unknown_sibling"
    assert fleet.refusal("me", 7) == "not_a_sibling"
    fleet.topology_members([_Member("me", True, 7, "127.0.0.2:1"), _Member("b", True, 55, "127.0.0.3:1"),
                            _Member("c", True, 66, f"{RENDERED_WILDCARD}:1"), _Member("d", True, 0, "127.0.0.4:1")], now[0])
    assert fleet.refusal("b", 55) is None
    assert fleet.refusal("b", 2**62) == "wrong_epoch" and fleet.refusal("b", 54) == "wrong_epoch"
    assert fleet.refusal("d", 1) == "unregistered_sibling"
    assert fleet.refusal("listed", 1) == "unknown_sibling"  # the topology rules once it came
    assert "c" not in fleet.addresses() and fleet.addresses()["b"] == "127.0.0.3:1"
    # listed alive but silent past twice the dead-after time: what the reports name
    now[0] += 2.5
    assert fleet.unresponsive(now[0]) == ["b", "d"]


# ----------------------------------------------------------------------------- the controller


@contextlib.asynccontextmanager
async def controller(cfg: MeshConfig, dns: RecordingDns | None = None) -> AsyncIterator[tuple[ControllerService, Any]]:
    svc = ControllerService(cfg, dns)
    await svc.start()
    try:
        async with grpc.aio.insecure_channel(str(cfg.controller.listen)) as ch:
            yield svc, mesh_pb2_grpc.ControllerStub(ch)
    finally:
        await svc.stop()


def register(balancer_id: str, host: str, epoch: int) -> Any:
    return mesh_pb2.RegisterRequest(region=US, balancer_id=balancer_id, epoch=epoch,
                                    member_grpc_address=f"{host}:9000", member_http_url=f"http://{host}:8000")


def members_of(svc: ControllerService) -> dict[str, Any]:
    return {m.balancer_id: m for a in svc.topology().balancers if a.region == US for m in a.members}


async def test_every_instance_of_a_registered_fleet_is_its_own_member_matched_by_id(tmp_path: Path) -> None:
    cfg = parse_config(registered_fleet(tmp_path))
    async with controller(cfg) as (svc, stub):
        assert US in svc.alive_regions()  # presumed alive until its balancers had time to register
        regs = {bid: await stub.Register(register(bid, host, 1000 + k), timeout=5)
                for k, (bid, host) in enumerate((("i-0aaaaaaaa", "10.0.1.1"), ("i-0bbbbbbbb", "10.0.1.2"),
                                                 ("i-0cccccccc", RENDERED_WILDCARD)))}
        assert all(r.accepted for r in regs.values())
        listed = members_of(svc)
        assert set(listed) == {"i-0aaaaaaaa", "i-0bbbbbbbb", "i-0cccccccc"}
        assert listed["i-0aaaaaaaa"].grpc_address == "10.0.1.1:9000"
        assert listed["i-0aaaaaaaa"].http_url == "http://10.0.1.1:8000"
        assert listed["i-0cccccccc"].grpc_address == "" and listed["i-0cccccccc"].http_url == ""  # never a wildcard
        assert [listed[b].instance_epoch for b in sorted(listed)] == [1000, 1001, 1002]
        assert len({m.epoch for m in listed.values()}) == 3
        # a restart of one instance (same id, new process): the same member, a new epoch
        again = await stub.Register(register("i-0bbbbbbbb", "10.0.1.2", 2000), timeout=5)
        assert again.epoch > max(r.epoch for r in regs.values())
        assert len(members_of(svc)) == 3 and members_of(svc)["i-0bbbbbbbb"].instance_epoch == 2000
        # an id is required in a registered fleet
        anon = await stub.Register(mesh_pb2.RegisterRequest(region=US, member_grpc_address="10.0.1.9:9000"),
                                   timeout=5)
        assert not anon.accepted and len(members_of(svc)) == 3
        # one leaves: the region stays
        left = await stub.Deregister(mesh_pb2.DeregisterRequest(
            region=US, balancer_id="i-0aaaaaaaa", epoch=regs["i-0aaaaaaaa"].epoch), timeout=5)
        assert left.accepted and US in svc.alive_regions()
    # the state file kept every member and its own epoch (read as a restarted controller does)
    restarted = ControllerService(cfg)
    try:
        recovered = {m.key: m for m in restarted.regions[US].members}
        assert recovered["i-0bbbbbbbb"].instance_epoch == 2000 and not recovered["i-0aaaaaaaa"].alive
    finally:
        restarted.store.close()
        restarted.membership.close()


async def test_a_registered_fleet_with_no_balancer_is_out_of_dns_after_its_grace(tmp_path: Path) -> None:
    cfg = parse_config(registered_fleet(tmp_path))
    dns = RecordingDns()
    async with controller(cfg, dns) as (svc, _):
        for _ in range(600):  # hang guard
            if US not in svc.alive_regions() and dns.calls and US not in dns.healthy():
                break
            await asyncio.sleep(0.05)
        assert US not in svc.alive_regions() and US not in dns.healthy()


async def test_a_replica_drained_under_two_members_leaves_only_when_both_report_it_idle(tmp_path: Path) -> None:
    cfg = parse_config(registered_fleet(tmp_path))
    async with controller(cfg) as (svc, stub):
        regs = {bid: await stub.Register(register(bid, host, 10), timeout=5)
                for bid, host in (("m-a", "10.0.1.1"), ("m-b", "10.0.1.2"))}
        # a registered replica (the registration API's table) leaves: it drains
        table = svc.membership.table
        table.register("joiner", "http://10.0.2.1:8000", US, 600.0)
        assert table.deregister("joiner")
        drain_version = table.members["joiner"].drain_version

        async def report(bid: str, in_flight: int) -> None:
            admin = {"topology_version": drain_version, "replicas": {"joiner": {"in_flight": in_flight}}}
            await stub.Report(mesh_pb2.BalancerReport(region=US, balancer_id=bid, epoch=regs[bid].epoch,
                                                      admin_json=json.dumps(admin)), timeout=5)

        def draining() -> bool:
            return any(x["replica_id"] == "joiner" for x in svc.membership.status_json())

        # m-a reports it idle last, m-b still has a request on it: it stays
        await report("m-b", 1)
        await report("m-a", 0)
        await svc.membership.sweep_once()
        assert draining()
        await report("m-b", 0)
        await svc.membership.sweep_once()
        assert not draining()
