"""The region's entry follows the controller (controller/entry_targets.py) and members
watch each other (controller/sibling_watch.py), against moto's Elastic Load Balancing and
EC2 (a moto server on loopback): a registered fleet's two members report to a controller
in this process; one goes quiet while the other names it unresponsive, and it leaves the
topology and the target group; it reports again and is back in both. Two members that
name each other while both report take nobody out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import boto3
import grpc
import pytest

from controller.balancer_members import MemberState
from controller.entry_targets import wanted_targets
from controller.reload_rules import controller_reload_plan
from controller.service import ControllerService
from skymesh.config import ConfigError, MeshConfig, parse_config
from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from tests.mesh_helpers import local_config_free_ports

pytestmark = pytest.mark.timeout(180)

US = "us-east-1"
ARN = "arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/skymesh-use1-entry/50dc6c495c0c9188"


async def wait_until(pred: Callable[[], bool], what: str, within_s: float = 120.0) -> None:
    """Polls ``pred``; ``within_s`` is a hang guard only."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def fleet_data(tmp_path: Path, **balancer: Any) -> dict[str, Any]:
    """local.yaml on free ports, us-east-1 a registered fleet in AWS us-east-1; the probes
    are slow to kill (a member is dead by its siblings long before failure_threshold)."""
    data = local_config_free_ports()
    data["emulate_latency"] = False
    data["controller"].update(state_path=str(tmp_path / "controller.sqlite"), probe_interval_s=0.2,
                              failure_threshold=100)
    region = data["regions"][0]
    assert region["name"] == US
    region["aws_region"] = US
    region["balancer"].update(fleet="registered", **balancer)
    return data


def test_entry_target_groups_are_validated(tmp_path: Path) -> None:
    cfg = parse_config(fleet_data(tmp_path, entry_target_groups=[ARN]))
    assert cfg.region(US).balancer.entry_target_groups == (ARN,)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"entry_target_groups": ["arn:aws:ec2:us-east-1:123456789012:instance/i-1"]}, "target group ARN"),
        ({"entry_target_groups": [ARN.replace("us-east-1", "eu-west-1")]}, "not the region's aws_region"),
        ({"entry_target_groups": [ARN, ARN]}, "listed twice"),
        ({"entry_target_groups": [ARN + "\n"]}, "target group ARN"),
        ({"entry_endpoint_url": "http://127.0.0.1:5000"}, "there are none"),
    ]
    for balancer, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_config(fleet_data(tmp_path, **balancer))
    no_region = fleet_data(tmp_path, entry_target_groups=[ARN])
    del no_region["regions"][0]["aws_region"]
    with pytest.raises(ConfigError, match="needs the region's aws_region"):
        parse_config(no_region)


def test_changing_the_entry_needs_a_restart(tmp_path: Path) -> None:
    old = parse_config(fleet_data(tmp_path))
    new = parse_config(fleet_data(tmp_path, entry_target_groups=[ARN]))
    assert controller_reload_plan(old, new).needs_restart


def test_only_instance_ids_are_entry_targets_and_an_instance_belongs_while_any_record_lives() -> None:
    def m(key: str, bid: str, alive: bool, draining: bool = False) -> MemberState:
        return MemberState(key=key, configured=False, http_url="", grpc_address="", probe_url="",
                           balancer_id=bid, alive=alive, draining=draining)

    members = {US: [m("a", "i-0123456789abcdef0", True), m("b", "i-0123456789abcdef1", True, draining=True),
                    m("c", "us-east-1-b2", True), m("d", "i-0123456789abcdef2", False),
                    m("e", "i-0123456789abcdef2", True), m("f", "i-0123456789abcdef1", False)],
               "eu-west-1": [m("x", "i-0123456789abcdef9", True)]}
    assert wanted_targets(members, [US]) == {(US, "i-0123456789abcdef0"): True, (US, "i-0123456789abcdef1"): False,
                                             (US, "i-0123456789abcdef2"): True}
    # every member of a region dead (the controller cut off from it, as likely as the
    # reverse): nothing is deregistered, the groups' own health checks decide
    all_dead = {US: [m("a", "i-0123456789abcdef0", False), m("b", "i-0123456789abcdef1", True, draining=True)]}
    assert wanted_targets(all_dead, [US]) == {}


class Elb:
    """The moto account: a VPC, two instances (the fleet's members), one TCP target group."""

    def __init__(self, url: str) -> None:
        kw: dict[str, Any] = {"region_name": US, "endpoint_url": url}
        ec2 = boto3.client("ec2", **kw)
        self.elb = boto3.client("elbv2", **kw)
        vpc = ec2.create_vpc(CidrBlock="10.1.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.1.1.0/24", AvailabilityZone="us-east-1a")
        image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        run = ec2.run_instances(ImageId=image, MinCount=2, MaxCount=2, SubnetId=subnet["Subnet"]["SubnetId"])
        self.a, self.b = sorted(str(i["InstanceId"]) for i in run["Instances"])
        self.group = self.elb.create_target_group(
            Name="skymesh-use1-entry", Protocol="TCP", Port=8000, VpcId=vpc,
            TargetType="instance")["TargetGroups"][0]["TargetGroupArn"]
        self.elb.register_targets(TargetGroupArn=self.group, Targets=[{"Id": self.a}, {"Id": self.b}])

    def targets(self) -> set[str]:
        health = self.elb.describe_target_health(TargetGroupArn=self.group)["TargetHealthDescriptions"]
        return {str(t["Target"]["Id"]) for t in health}


@contextlib.asynccontextmanager
async def controller(cfg: MeshConfig) -> AsyncIterator[tuple[ControllerService, Any]]:
    svc = ControllerService(cfg)
    await svc.start()
    try:
        async with grpc.aio.insecure_channel(str(cfg.controller.listen)) as ch:
            yield svc, mesh_pb2_grpc.ControllerStub(ch)
    finally:
        await svc.stop()


class Reporter:
    """One member's report loop (every 0.2 s while ``reporting``), naming ``unresponsive``."""

    def __init__(self, stub: Any, balancer_id: str) -> None:
        self.stub = stub
        self.balancer_id = balancer_id
        self.epoch = 0
        self.reporting = True
        self.unresponsive: list[str] = []
        self.sent = 0
        self.task: asyncio.Task[None] | None = None

    async def register(self) -> None:
        reply = await self.stub.Register(mesh_pb2.RegisterRequest(region=US, balancer_id=self.balancer_id), timeout=10)
        assert reply.accepted, reply.reason
        self.epoch = reply.epoch
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            if self.reporting:
                await self.stub.Report(mesh_pb2.BalancerReport(
                    region=US, balancer_id=self.balancer_id, epoch=self.epoch,
                    unresponsive_siblings=self.unresponsive), timeout=10)
                self.sent += 1
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


def member_alive(svc: ControllerService, balancer_id: str) -> bool:
    return next(m.alive for m in svc.regions[US].members if m.balancer_id == balancer_id)


def taken_out(svc: ControllerService, reason: str) -> float:
    return svc.metrics.members_taken_out.labels(US, reason)._value.get()


async def test_a_quiet_member_its_sibling_names_leaves_the_topology_and_the_entry(tmp_path: Path,
                                                                                   moto_url: str) -> None:
    aws = Elb(moto_url)
    cfg = parse_config(fleet_data(tmp_path, entry_target_groups=[aws.group], entry_endpoint_url=moto_url))
    async with controller(cfg) as (svc, stub):
        a, b = Reporter(stub, aws.a), Reporter(stub, aws.b)
        try:
            await a.register()
            await b.register()
            await wait_until(lambda: svc.entry is not None and svc.entry.done == {(US, aws.a): True, (US, aws.b): True},
                             "both members registered in the entry")
            assert aws.targets() == {aws.a, aws.b}

            # b freezes: its reports stop, and a names it
            b.reporting = False
            a.unresponsive = [aws.b, "i-00000000000000000", "junk" * 100]
            await wait_until(lambda: not member_alive(svc, aws.b), "b marked dead")
            assert taken_out(svc, "siblings") == 1 and taken_out(svc, "probes") == 0
            listed = {m.balancer_id: m.alive for a_ in svc.topology().balancers if a_.region == US for m in a_.members}
            assert listed == {aws.a: True, aws.b: False}
            await wait_until(lambda: aws.targets() == {aws.a}, "b deregistered from the target group")
            # moto shows a call's effect before the controller's thread returns from it and
            # counts it: the counts are read once the controller recorded the call done
            await wait_until(lambda: svc.entry is not None and svc.entry.done.get((US, aws.b)) is False,
                             "the controller done with b's deregistration")
            assert member_alive(svc, aws.a)

            # b reports again: alive, and back in the entry
            a.unresponsive = []
            b.reporting = True
            await wait_until(lambda: member_alive(svc, aws.b), "b alive again")
            await wait_until(lambda: aws.targets() == {aws.a, aws.b}, "b registered again")
            await wait_until(lambda: svc.entry is not None and svc.entry.done.get((US, aws.b)) is True,
                             "the controller done with b's registration")
            calls = svc.entry.calls if svc.entry is not None else None
            assert calls is not None and calls.labels("deregister", "ok")._value.get() == 1
            assert calls.labels("register", "ok")._value.get() == 3
        finally:
            await a.stop()
            await b.stop()


async def test_two_members_naming_each_other_while_both_report_stay(tmp_path: Path, moto_url: str) -> None:
    aws = Elb(moto_url)
    cfg = parse_config(fleet_data(tmp_path, entry_target_groups=[aws.group], entry_endpoint_url=moto_url))
    async with controller(cfg) as (svc, stub):
        a, b = Reporter(stub, aws.a), Reporter(stub, aws.b)
        try:
            await a.register()
            await b.register()
            a.unresponsive, b.unresponsive = [aws.b], [aws.a]
            # each report and each probe round judges them: wait for reports spanning more
            # than the verdict's quiet window (15 reports 0.2 s apart, 2.5 s quiet)
            start_a, start_b = a.sent, b.sent
            await wait_until(lambda: a.sent >= start_a + 15 and b.sent >= start_b + 15,
                             "reports past the quiet window")
            assert member_alive(svc, aws.a) and member_alive(svc, aws.b)
            assert taken_out(svc, "siblings") == 0
            assert aws.targets() == {aws.a, aws.b}
        finally:
            await a.stop()
            await b.stop()


async def test_a_failing_entry_api_never_stops_the_controller_and_is_retried(tmp_path: Path, moto_url: str) -> None:
    aws = Elb(moto_url)
    # a target group that does not exist: every call fails, the controller carries on
    missing = ARN
    cfg = parse_config(fleet_data(tmp_path, entry_target_groups=[missing], entry_endpoint_url=moto_url))
    async with controller(cfg) as (svc, stub):
        a = Reporter(stub, aws.a)
        try:
            await a.register()
            entry = svc.entry
            assert entry is not None
            await wait_until(lambda: entry.calls.labels("register", "error")._value.get() >= 3,
                             "the failing call retried round after round")
            assert entry.done == {} and member_alive(svc, aws.a)
        finally:
            await a.stop()
