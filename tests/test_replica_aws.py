"""The AWS membership source against moto's EC2 and Auto Scaling (a moto server on
loopback): a real controller polls it, the InService instances of an Auto Scaling group
and the instances tagged ``skymesh:region=<name>`` become replicas at their private IPs,
and the ones scaled in or terminated drain, then leave. A failing AWS API changes nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest

from controller.membership import Discovered
from controller.service import ControllerService
from skymesh.config import MeshConfig, parse_config
from skymesh.runtime.procs import free_port
from tests.mesh_helpers import local_config_free_ports

pytestmark = pytest.mark.timeout(180)

GROUP = "skymesh-replicas-use1"
TAG = "skymesh:region"


async def wait_until(pred: Callable[[], bool], what: str, within_s: float = 120.0,
                     state: Callable[[], str] | None = None) -> None:
    """Polls ``pred``; ``within_s`` is a hang guard only."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}" + (f" ({state()})" if state is not None else ""))


def aws_cfg(tmp_path: Path, endpoint_url: str, **source: Any) -> MeshConfig:
    data = local_config_free_ports()
    data["emulate_latency"] = False
    data["controller"]["state_path"] = str(tmp_path / "controller.sqlite")
    data["membership"] = {"drain_grace_s": 0.5, "aws": [{
        "aws_region": "us-east-1", "endpoint_url": endpoint_url, "poll_interval_s": 0.2, "port": 8000,
        **source}]}
    return parse_config(data)


class Aws:
    """The moto account the test drives: a VPC, a subnet, a launch template, one group."""

    def __init__(self, url: str) -> None:
        kw: dict[str, Any] = {"region_name": "us-east-1", "endpoint_url": url}
        self.ec2 = boto3.client("ec2", **kw)
        self.asg = boto3.client("autoscaling", **kw)
        vpc = self.ec2.create_vpc(CidrBlock="10.1.0.0/16")["Vpc"]["VpcId"]
        self.subnet = self.ec2.create_subnet(VpcId=vpc, CidrBlock="10.1.1.0/24",
                                             AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
        self.image = self.ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        self.ec2.create_launch_template(LaunchTemplateName="replica", LaunchTemplateData={
            "ImageId": self.image, "InstanceType": "t3.micro"})

    def create_group(self, desired: int) -> None:
        self.asg.create_auto_scaling_group(
            AutoScalingGroupName=GROUP, LaunchTemplate={"LaunchTemplateName": "replica", "Version": "$Latest"},
            MinSize=0, MaxSize=5, DesiredCapacity=desired, VPCZoneIdentifier=self.subnet)

    def group_instances(self) -> dict[str, str]:
        """InService instance id -> its replica URL."""
        group = self.asg.describe_auto_scaling_groups(AutoScalingGroupNames=[GROUP])["AutoScalingGroups"][0]
        ids = [i["InstanceId"] for i in group["Instances"] if i["LifecycleState"] == "InService"]
        return self.urls(ids)

    def urls(self, ids: list[str]) -> dict[str, str]:
        if not ids:
            return {}
        out = {}
        for res in self.ec2.describe_instances(InstanceIds=ids)["Reservations"]:
            for inst in res["Instances"]:
                out[inst["InstanceId"]] = f"http://{inst['PrivateIpAddress']}:8000"
        return out

    def run_tagged(self, region: str) -> str:
        inst = self.ec2.run_instances(ImageId=self.image, MinCount=1, MaxCount=1, SubnetId=self.subnet,
                                      TagSpecifications=[{"ResourceType": "instance",
                                                          "Tags": [{"Key": TAG, "Value": region}]}])
        return str(inst["Instances"][0]["InstanceId"])


def replicas_of(svc: ControllerService) -> dict[str, tuple[str, str, bool]]:
    """replica id -> (url, home region, draining), from the topology the balancers get."""
    return {x.replica_id: (x.url, x.home_region, x.draining) for b in svc.topology().balancers for x in b.replicas}


async def test_group_and_tagged_instances_join_and_scaled_in_ones_drain(tmp_path: Path, moto_url: str) -> None:
    aws = Aws(moto_url)
    aws.create_group(desired=2)
    tagged = aws.run_tagged("eu-west-1")
    aws.run_tagged("mars-1")  # names no configured region: ignored
    # the group runs decode replicas (a P/D deployment's decode pool); a tagged one is both
    cfg = aws_cfg(tmp_path, moto_url, auto_scaling_groups=[{"name": GROUP, "region": "us-east-1", "role": "decode"}],
                  tag_key=TAG)
    static = {rep.id for r in cfg.regions for rep in r.replicas}
    svc = ControllerService(cfg)
    await svc.start()
    try:
        in_group = aws.group_instances()
        assert len(in_group) == 2
        want = {**{iid: (url, "us-east-1", False) for iid, url in in_group.items()},
                tagged: (aws.urls([tagged])[tagged], "eu-west-1", False)}
        assert all(url.startswith("http://10.1.1.") for url, _, _ in want.values())

        def discovered() -> dict[str, tuple[str, str, bool]]:
            return {k: v for k, v in replicas_of(svc).items() if k not in static}

        await wait_until(lambda: discovered() == want, "the instances became replicas",
                         state=lambda: f"want {want}, have {discovered()}")
        roles = {x.replica_id: x.role for b in svc.topology().balancers for x in b.replicas}
        assert {iid: roles[iid] for iid in want} == {**dict.fromkeys(in_group, "decode"), tagged: "both"}
        assert {iid: svc.replica_roles()[iid] for iid in want} == {**dict.fromkeys(in_group, "decode"),
                                                                  tagged: "both"}
        assert svc.metrics.registry.get_sample_value(
            "skymesh_membership_replicas", {"region": "us-east-1", "source": "aws:us-east-1"}) == 2

        # scale in: the instance the group drops drains, then leaves
        aws.asg.set_desired_capacity(AutoScalingGroupName=GROUP, DesiredCapacity=1)
        kept = aws.group_instances()
        assert len(kept) == 1
        (dropped,) = set(in_group) - set(kept)
        seen_draining = False

        def dropped_left() -> bool:
            nonlocal seen_draining
            now = discovered()
            if dropped in now:
                seen_draining = seen_draining or now[dropped][2]
                return False
            return True

        await wait_until(dropped_left, "the scaled-in instance drained and left",
                         state=lambda: f"dropped {dropped}, have {discovered()}")
        assert seen_draining
        assert set(discovered()) == set(kept) | {tagged}

        # the tagged instance is terminated: it leaves too
        aws.ec2.terminate_instances(InstanceIds=[tagged])
        await wait_until(lambda: set(discovered()) == set(kept), "the terminated tagged instance left",
                         state=lambda: f"kept {kept}, have {discovered()}")
    finally:
        await svc.stop()


async def test_a_failing_aws_api_keeps_the_replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(k, v)
    # nothing listens there: every call fails to connect
    cfg = aws_cfg(tmp_path, f"http://127.0.0.1:{free_port()}", tag_key=TAG)
    svc = ControllerService(cfg)
    try:
        (src,) = svc.membership.aws
        table = svc.membership.table
        table.replace_source(src.name, [Discovered("i-0abc", "http://10.1.1.5:8000", "us-east-1")])
        assert not await svc.membership.poll_once(src)
        assert not table.members["i-0abc"].draining
        assert svc.metrics.registry.get_sample_value(
            "skymesh_membership_source_polls_total", {"source": src.name, "result": "error"}) == 1
    finally:
        svc.store.close()
        svc.membership.close()
