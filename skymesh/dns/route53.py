"""Route53 DNS provider (boto3): latency records bound to HTTP health checks.

For every regional balancer the provider keeps one HTTP health check (identified by a
stable CallerReference prefix, so it is found again after a controller restart) and one
latency record for the mesh name: ``A``, ``SetIdentifier = skymesh-<region>``,
``Region = <AWS region>``, ``HealthCheckId`` bound. Route53 then answers each client with
the lowest-latency region whose check passes.

The controller's own view is applied on top: a balancer the controller has declared dead
loses its record at once (its health check stays, ready for the recovery), so traffic
shifts before Route53's checkers notice. ``failover=True`` (exactly two regions) writes
PRIMARY/SECONDARY failover records instead.

``sync`` is idempotent: it reads what exists and sends one change batch only when the
desired state differs, then waits for ``INSYNC``. Every record set is validated locally
first, because an emulator accepts nonsense that AWS rejects.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import time
from typing import Any

import boto3

from skymesh.dns.base import BalancerEndpoint

# Regions Route53 accepts in latency records
AWS_LATENCY_REGIONS = frozenset({
    "us-east-1", "us-east-2", "us-west-1", "us-west-2", "ca-central-1", "ca-west-1",
    "eu-west-1", "eu-west-2", "eu-west-3", "eu-central-1", "eu-central-2", "eu-north-1",
    "eu-south-1", "eu-south-2", "ap-south-1", "ap-south-2", "ap-northeast-1", "ap-northeast-2",
    "ap-northeast-3", "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-southeast-4",
    "ap-southeast-5", "ap-east-1", "sa-east-1", "me-south-1", "me-central-1", "af-south-1",
    "il-central-1", "mx-central-1", "cn-north-1", "cn-northwest-1",
})
SET_ID_PREFIX = "skymesh-"


class Route53ValidationError(ValueError):
    """A record set or health check AWS would reject; raised before anything is sent."""


def _fqdn(name: str) -> str:
    return name if name.endswith(".") else name + "."


class Route53Provider:
    name = "route53"

    def __init__(
        self,
        zone_name: str,
        record_name: str,
        ttl: int = 5,
        endpoint_url: str | None = None,
        region_name: str = "us-east-1",
        failover: bool = False,
        wait_insync: bool = True,
        client: Any = None,
        insync_timeout_s: float = 120.0,
    ) -> None:
        self.zone_name = _fqdn(zone_name)
        self.record_name = _fqdn(record_name)
        if not self.record_name.endswith(self.zone_name):
            raise Route53ValidationError(f"record {self.record_name} is not inside zone {self.zone_name}")
        self.ttl = ttl
        self.failover = failover
        self.wait_insync = wait_insync
        self.insync_timeout_s = insync_timeout_s
        self.client = client or boto3.client("route53", endpoint_url=endpoint_url, region_name=region_name)
        self._zone_id: str | None = None
        self.changes_sent = 0

    # ------------------------------------------------------------------ public API

    async def sync(self, endpoints: list[BalancerEndpoint]) -> bool:
        return await asyncio.to_thread(self.sync_blocking, endpoints)

    async def close(self) -> None:
        return None

    # ------------------------------------------------------------------ reading

    def zone_id(self) -> str:
        if self._zone_id is None:
            resp = self.client.list_hosted_zones_by_name(DNSName=self.zone_name)
            for z in resp.get("HostedZones", []):
                if z["Name"] == self.zone_name and not z.get("Config", {}).get("PrivateZone", False):
                    self._zone_id = z["Id"].split("/")[-1]
                    break
            else:
                raise LookupError(f"no public hosted zone named {self.zone_name}")
        return self._zone_id

    def _caller_prefix(self, region: str) -> str:
        return f"skymesh:{self.record_name}:{region}:"

    def health_checks(self) -> dict[str, dict[str, Any]]:
        """region -> health check, for the checks this provider created."""
        out: dict[str, dict[str, Any]] = {}
        paginator = self.client.get_paginator("list_health_checks")
        for page in paginator.paginate():
            for hc in page.get("HealthChecks", []):
                ref = hc.get("CallerReference", "")
                prefix = f"skymesh:{self.record_name}:"
                if ref.startswith(prefix):
                    region = ref[len(prefix):].split(":", 1)[0]
                    out[region] = hc
        return out

    def record_sets(self) -> dict[str, dict[str, Any]]:
        """SetIdentifier -> record set, for this provider's records of the mesh name."""
        out: dict[str, dict[str, Any]] = {}
        paginator = self.client.get_paginator("list_resource_record_sets")
        for page in paginator.paginate(HostedZoneId=self.zone_id()):
            for rr in page.get("ResourceRecordSets", []):
                if rr["Name"] == self.record_name and rr.get("SetIdentifier", "").startswith(SET_ID_PREFIX):
                    out[rr["SetIdentifier"]] = rr
        return out

    # ------------------------------------------------------------------ desired state

    def _check_config(self, ep: BalancerEndpoint) -> dict[str, Any]:
        return {
            "IPAddress": ep.ip,
            "Port": ep.port,
            "Type": "HTTP",
            "ResourcePath": ep.health_path,
            "RequestInterval": 10,
            "FailureThreshold": 3,
        }

    def _caller_reference(self, ep: BalancerEndpoint) -> str:
        digest = hashlib.sha256(f"{ep.ip}|{ep.port}|{ep.health_path}".encode()).hexdigest()[:12]
        return self._caller_prefix(ep.region) + digest

    def desired_records(self, endpoints: list[BalancerEndpoint], checks: dict[str, str]) -> dict[str, dict[str, Any]]:
        recs: dict[str, dict[str, Any]] = {}
        if self.failover:
            ordered = sorted(endpoints, key=lambda e: not e.healthy)  # a live one is PRIMARY
            for role, ep in zip(("PRIMARY", "SECONDARY"), ordered, strict=False):
                sid = f"{SET_ID_PREFIX}{ep.region}"
                recs[sid] = {
                    "Name": self.record_name, "Type": "A", "SetIdentifier": sid, "Failover": role,
                    "TTL": self.ttl, "ResourceRecords": [{"Value": ep.ip}], "HealthCheckId": checks[ep.region],
                }
            return recs
        for ep in endpoints:
            if not ep.healthy:
                continue  # declared dead by the controller: out of DNS now
            sid = f"{SET_ID_PREFIX}{ep.region}"
            recs[sid] = {
                "Name": self.record_name, "Type": "A", "SetIdentifier": sid,
                "Region": ep.aws_region or ep.region, "TTL": self.ttl,
                "ResourceRecords": [{"Value": ep.ip}], "HealthCheckId": checks[ep.region],
            }
        return recs

    # ------------------------------------------------------------------ validation

    def validate(self, endpoints: list[BalancerEndpoint]) -> None:
        regions = [e.region for e in endpoints]
        if len(set(regions)) != len(regions):
            raise Route53ValidationError(f"duplicate regions in {regions}")
        if self.failover and len(endpoints) != 2:
            raise Route53ValidationError(f"failover mode needs exactly 2 regions, got {len(endpoints)}")
        if not 0 <= self.ttl <= 2_147_483_647:
            raise Route53ValidationError(f"TTL {self.ttl} is outside 0..2147483647")
        for ep in endpoints:
            where = f"balancer {ep.region}"
            try:
                addr = ipaddress.ip_address(ep.ip)
            except ValueError:
                raise Route53ValidationError(f"{where}: {ep.ip!r} is not an IP address") from None
            if addr.version != 4:
                raise Route53ValidationError(f"{where}: {ep.ip} is not IPv4 (A records)")
            if not addr.is_global:
                raise Route53ValidationError(
                    f"{where}: {ep.ip} is not a public address; Route53 health checks and public "
                    "records need one (set regions[].balancer.public_ip)"
                )
            if not 1 <= ep.port <= 65535:
                raise Route53ValidationError(f"{where}: port {ep.port} is invalid")
            if not ep.health_path.startswith("/") or len(ep.health_path) > 255:
                raise Route53ValidationError(f"{where}: health path {ep.health_path!r} must start with / (≤255)")
            if not self.failover:
                region = ep.aws_region or ep.region
                if region not in AWS_LATENCY_REGIONS:
                    raise Route53ValidationError(
                        f"{where}: {region!r} is not a Route53 latency region (set regions[].aws_region)"
                    )
            sid = f"{SET_ID_PREFIX}{ep.region}"
            if len(sid) > 128:
                raise Route53ValidationError(f"{where}: SetIdentifier {sid!r} longer than 128")

    def _check_existing_policy(self, existing_all: list[dict[str, Any]]) -> None:
        """AWS rejects mixing routing policies on one name; refuse to add ours to a
        name that already carries simple or other-policy records we do not own."""
        want = "Failover" if self.failover else "Region"
        for rr in existing_all:
            if rr["Name"] != self.record_name or rr["Type"] not in ("A", "CNAME"):
                continue
            sid = rr.get("SetIdentifier", "")
            if not sid:
                raise Route53ValidationError(f"{self.record_name} already has a simple {rr['Type']} record")
            if not sid.startswith(SET_ID_PREFIX) and want not in rr:
                raise Route53ValidationError(
                    f"{self.record_name} has record {sid!r} with another routing policy"
                )

    # ------------------------------------------------------------------ sync

    def sync_blocking(self, endpoints: list[BalancerEndpoint]) -> bool:
        self.validate(endpoints)
        zone = self.zone_id()
        all_sets = self.client.list_resource_record_sets(
            HostedZoneId=zone, StartRecordName=self.record_name, StartRecordType="A"
        ).get("ResourceRecordSets", [])
        self._check_existing_policy(all_sets)
        changed = False
        checks = self.health_checks()
        wanted_regions = {e.region for e in endpoints}
        check_ids: dict[str, str] = {}
        for ep in endpoints:
            hc = checks.get(ep.region)
            ref = self._caller_reference(ep)
            if hc is not None and hc["CallerReference"] != ref:
                hc = None  # address or port changed: a new check replaces the old one
            if hc is None:
                resp = self.client.create_health_check(CallerReference=ref, HealthCheckConfig=self._check_config(ep))
                hc = resp["HealthCheck"]
                self.client.change_tags_for_resource(
                    ResourceType="healthcheck", ResourceId=hc["Id"],
                    AddTags=[{"Key": "skymesh:region", "Value": ep.region},
                             {"Key": "Name", "Value": f"skymesh {ep.region}"}],
                )
                changed = True
            check_ids[ep.region] = hc["Id"]
        existing = self.record_sets()
        desired = self.desired_records(endpoints, check_ids)
        changes: list[dict[str, Any]] = []
        for sid, rec in desired.items():
            if not _same_record(existing.get(sid), rec):
                changes.append({"Action": "UPSERT", "ResourceRecordSet": rec})
        for sid, rec in existing.items():
            if sid not in desired:
                changes.append({"Action": "DELETE", "ResourceRecordSet": rec})
        if changes:
            resp = self.client.change_resource_record_sets(
                HostedZoneId=zone,
                ChangeBatch={"Comment": "skymesh controller sync", "Changes": changes},
            )
            self.changes_sent += 1
            changed = True
            if self.wait_insync:
                self._wait_insync(resp["ChangeInfo"]["Id"])
        # health checks of balancers that left the mesh (after their records are gone)
        live_check_ids = set(check_ids.values())
        for region, hc in self.health_checks().items():
            if region not in wanted_regions or hc["Id"] not in live_check_ids:
                self.client.delete_health_check(HealthCheckId=hc["Id"])
                changed = True
        return changed

    def _wait_insync(self, change_id: str) -> None:
        deadline = time.monotonic() + self.insync_timeout_s
        delay = 0.2
        while True:
            status = self.client.get_change(Id=change_id)["ChangeInfo"]["Status"]
            if status == "INSYNC":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Route53 change {change_id} not INSYNC after {self.insync_timeout_s}s")
            time.sleep(delay)
            delay = min(5.0, delay * 2)


def _same_record(have: dict[str, Any] | None, want: dict[str, Any]) -> bool:
    if have is None:
        return False
    keys = ("Type", "TTL", "Region", "Failover", "HealthCheckId")
    if any(have.get(k) != want.get(k) for k in keys):
        return False
    return sorted(r["Value"] for r in have.get("ResourceRecords", [])) == sorted(
        r["Value"] for r in want["ResourceRecords"]
    )
