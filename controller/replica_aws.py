"""The AWS source: replicas discovered by polling one AWS region (``membership.aws[]``).

Each poll lists the InService instances of the configured Auto Scaling groups and/or the
running EC2 instances tagged ``<tag_key>=<skymesh region>``; each becomes the replica
``<instance id>`` at ``<scheme>://<private IP>:<port>``. An instance gone from the list
(scaled in, terminated, out of service) drains. A poll that fails changes nothing: an
AWS API outage must not empty a region. boto3 is imported only when a source is
configured; its blocking calls run in a thread.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterator
from typing import Any

from controller.membership import Discovered, aws_source_name
from skymesh.config import REPLICA_ID_RE, AwsSourceConfig
from skymesh.routing.pairing.base import Role

log = logging.getLogger("skymesh.controller.aws")

# instance ids per DescribeInstances call (the API's filter limit is 1000 values)
_IDS_PER_CALL = 200


class AwsSource:
    def __init__(self, cfg: AwsSourceConfig, regions: frozenset[str]) -> None:
        import boto3
        from botocore.config import Config

        self.cfg = cfg
        self.name = aws_source_name(cfg.aws_region)
        # tag values that name a configured region (any other value is ignored)
        self.regions = regions
        # a poll is retried by the next poll: few retries, bounded waits (a hung call would
        # hold a thread and delay every later poll)
        kwargs: dict[str, Any] = {"region_name": cfg.aws_region, "config": Config(
            retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=5, read_timeout=15)}
        if cfg.endpoint_url is not None:
            kwargs["endpoint_url"] = cfg.endpoint_url
        self._autoscaling = boto3.client("autoscaling", **kwargs)
        self._ec2 = boto3.client("ec2", **kwargs)

    def poll(self) -> list[Discovered]:
        """Blocking: the replicas the source has now (raises on an API error)."""
        wanted: dict[str, tuple[str, Role]] = {}  # instance id -> (region, role)
        if self.cfg.auto_scaling_groups:
            region_of_group = {g.name: (g.region, g.role) for g in self.cfg.auto_scaling_groups}
            pages = self._autoscaling.get_paginator("describe_auto_scaling_groups").paginate(
                AutoScalingGroupNames=list(region_of_group))
            for page in pages:
                for group in page.get("AutoScalingGroups", []):
                    region = region_of_group.get(group.get("AutoScalingGroupName"))
                    if region is None:
                        continue
                    for inst in group.get("Instances", []):
                        if inst.get("LifecycleState") == "InService" and isinstance(inst.get("InstanceId"), str):
                            wanted.setdefault(inst["InstanceId"], region)
        found: dict[str, Discovered] = {}
        ids = sorted(wanted)
        for i in range(0, len(ids), _IDS_PER_CALL):
            for inst in self._instances(InstanceIds=ids[i:i + _IDS_PER_CALL]):
                region, role = wanted.get(inst.get("InstanceId", ""), (None, "both"))
                d = self._replica(inst, region, role)
                if d is not None:
                    found.setdefault(d.replica_id, d)
        if self.cfg.tag_key is not None:
            for inst in self._instances(Filters=[{"Name": f"tag:{self.cfg.tag_key}", "Values": sorted(self.regions)}]):
                tags = {t.get("Key"): t.get("Value") for t in inst.get("Tags", [])}
                d = self._replica(inst, tags.get(self.cfg.tag_key))
                if d is not None:
                    found.setdefault(d.replica_id, d)
        return [found[k] for k in sorted(found)]

    def _instances(self, **query: Any) -> Iterator[dict[str, Any]]:
        filters = [*query.pop("Filters", []), {"Name": "instance-state-name", "Values": ["running"]}]
        for page in self._ec2.get_paginator("describe_instances").paginate(Filters=filters, **query):
            for reservation in page.get("Reservations", []):
                yield from reservation.get("Instances", [])

    def _replica(self, inst: dict[str, Any], region: Any, role: Role = "both") -> Discovered | None:
        """The replica of one instance, or None (no region, no usable id or private IP); a
        tagged instance's role is ``both`` (a group's is the group's)."""
        iid, ip = inst.get("InstanceId"), inst.get("PrivateIpAddress")
        if region not in self.regions or not isinstance(iid, str) or not REPLICA_ID_RE.match(iid) or "\n" in iid:
            return None
        try:
            addr = ipaddress.ip_address(ip) if isinstance(ip, str) else None
        except ValueError:
            addr = None
        if addr is None:
            log.warning("instance without a usable private IP", extra={"instance": iid, "source": self.name})
            return None
        host = f"[{addr}]" if addr.version == 6 else str(addr)
        return Discovered(iid, f"{self.cfg.scheme}://{host}:{self.cfg.port}", region, role)
