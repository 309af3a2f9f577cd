"""Route53 DNS provider (boto3): latency records bound to HTTP health checks.

For every regional balancer the provider keeps one HTTP health check on
``http://<public ip>:<port><health_path>`` and one latency record for the mesh name:
``A``, ``SetIdentifier = skymesh-<region>``, ``Region = <AWS region>``, ``HealthCheckId``
bound. Route53 answers each client with the lowest-latency region whose check passes.

Health checks are identified by what they probe (IP, port, path), not by who made them:
a check created by terraform's ``dns`` module for the same balancer is adopted, so the
controller and ``terraform apply`` never fight. Checks the provider creates itself carry
a ``CallerReference`` of the form ``skymesh-<name hash>-<nonce>-<region>`` (at most 64
characters; the stable prefix finds them again after a controller restart, the nonce keeps
it unique, as AWS refuses to reuse the reference of a deleted check) and ``Name`` /
``skymesh:region`` tags. Only such owned checks are ever deleted.

Health semantics, two layers:

* Route53's own checkers evaluate every bound health check, so a balancer that stops
  answering loses its traffic even while the controller is down.
* The controller's view is applied on top: a balancer the controller has declared dead
  loses its latency record at once (its health check stays, ready for the recovery), so
  traffic shifts before Route53's checkers notice. When the controller believes *every*
  balancer is dead (more likely its own network is cut off than the whole mesh), it
  publishes all records and leaves the decision to Route53's checks, so the name never
  disappears.

``failover=True`` (exactly two regions) writes failover records instead: both stay
published, bound to their checks; PRIMARY is the first region in config order that the
controller considers alive.

``sync`` is idempotent: it reads the record sets of the name and the health checks, sends
one change batch only when the desired state differs, waits for ``INSYNC`` (bounded) and
then deletes owned checks no longer used. Every record set is validated locally first
(:mod:`skymesh.dns.route53_validate`), because an emulator accepts nonsense AWS rejects.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from typing import Any

import boto3
from botocore.config import Config

from skymesh.dns.base import BalancerEndpoint
from skymesh.dns.route53_validate import (
    Route53ValidationError,
    caller_reference_max,
    routing_policy,
    validate_endpoints,
    validate_record_sets,
)

__all__ = ["SET_ID_PREFIX", "Route53Provider", "Route53ValidationError"]

log = logging.getLogger(__name__)

SET_ID_PREFIX = "skymesh-"
CHECK_REQUEST_INTERVAL_S = 10
CHECK_FAILURE_THRESHOLD = 3


def _fqdn(name: str) -> str:
    name = name.lower()
    return name if name.endswith(".") else name + "."


def _short_hash(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


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
        insync_timeout_s: float = 300.0,
    ) -> None:
        self.zone_name = _fqdn(zone_name)
        self.record_name = _fqdn(record_name)
        if not ("." + self.record_name).endswith("." + self.zone_name):
            raise Route53ValidationError(f"record {self.record_name} is not inside zone {self.zone_name}")
        self.ttl = ttl
        self.failover = failover
        self.wait_insync = wait_insync
        self.insync_timeout_s = insync_timeout_s
        self._own_client = client is None
        self.client = client or boto3.client(
            "route53", endpoint_url=endpoint_url, region_name=region_name,
            # Route53 allows 5 requests/s per account: back off on throttling
            config=Config(retries={"mode": "standard", "max_attempts": 8}),
        )
        self._zone_id: str | None = None
        self._lock = asyncio.Lock()
        self._owner = f"{SET_ID_PREFIX}{_short_hash(self.record_name, 8)}-"
        self.changes_sent = 0

    # ------------------------------------------------------------------ public API

    async def sync(self, endpoints: list[BalancerEndpoint]) -> bool:
        async with self._lock:  # the controller may call from the probe loop and on events
            return await asyncio.to_thread(self.sync_blocking, endpoints)

    async def close(self) -> None:
        if self._own_client:
            await asyncio.to_thread(self.client.close)

    # ------------------------------------------------------------------ reading

    def zone_id(self) -> str:
        if self._zone_id is None:
            resp = self.client.list_hosted_zones_by_name(DNSName=self.zone_name)
            for z in resp.get("HostedZones", []):
                if z["Name"].lower() == self.zone_name and not z.get("Config", {}).get("PrivateZone", False):
                    self._zone_id = z["Id"].split("/")[-1]
                    break
            else:
                raise LookupError(f"no public hosted zone named {self.zone_name}")
        return self._zone_id

    def name_record_sets(self) -> list[dict[str, Any]]:
        """Every record set of the mesh name (ours and anyone else's)."""
        out: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"HostedZoneId": self.zone_id(), "StartRecordName": self.record_name}
        while True:
            resp = self.client.list_resource_record_sets(**kwargs)
            page = resp.get("ResourceRecordSets", [])
            out.extend(rr for rr in page if rr["Name"].lower() == self.record_name)
            past_name = any(rr["Name"].lower() != self.record_name for rr in page) and any(
                rr["Name"].lower() == self.record_name for rr in out
            )
            if not resp.get("IsTruncated") or past_name:
                return out
            kwargs["StartRecordName"] = resp["NextRecordName"]
            kwargs["StartRecordType"] = resp["NextRecordType"]
            if "NextRecordIdentifier" in resp:
                kwargs["StartRecordIdentifier"] = resp["NextRecordIdentifier"]
            else:
                kwargs.pop("StartRecordIdentifier", None)

    def record_sets(self) -> dict[str, dict[str, Any]]:
        """SetIdentifier -> record set, for this provider's records of the mesh name."""
        return {rr["SetIdentifier"]: rr for rr in self.name_record_sets() if self._ours(rr)}

    def all_health_checks(self) -> list[dict[str, Any]]:
        paginator = self.client.get_paginator("list_health_checks")
        return [hc for page in paginator.paginate() for hc in page.get("HealthChecks", [])]

    def health_checks(self) -> dict[str, dict[str, Any]]:
        """region key -> health check, for the checks this provider created."""
        out: dict[str, dict[str, Any]] = {}
        for hc in self.all_health_checks():
            key = self._owned_region_key(hc)
            if key is not None:
                out[key] = hc
        return out

    # ------------------------------------------------------------------ identities

    def _ours(self, rr: dict[str, Any]) -> bool:
        return rr.get("Type") == "A" and str(rr.get("SetIdentifier", "")).startswith(SET_ID_PREFIX)

    def _region_key(self, region: str) -> str:
        room = caller_reference_max() - len(self._owner) - 13  # 12-char nonce and a dash
        return region if len(region) <= room else "h" + _short_hash(region, 16)

    def _owned_region_key(self, hc: dict[str, Any]) -> str | None:
        ref = str(hc.get("CallerReference", ""))
        if not ref.startswith(self._owner):
            return None
        return ref[len(self._owner) + 13:]

    def _new_caller_reference(self, ep: BalancerEndpoint) -> str:
        return f"{self._owner}{uuid.uuid4().hex[:12]}-{self._region_key(ep.region)}"

    @staticmethod
    def _check_config(ep: BalancerEndpoint) -> dict[str, Any]:
        return {
            "IPAddress": ep.ip,
            "Port": ep.port,
            "Type": "HTTP",
            "ResourcePath": ep.health_path,
            "RequestInterval": CHECK_REQUEST_INTERVAL_S,
            "FailureThreshold": CHECK_FAILURE_THRESHOLD,
        }

    @staticmethod
    def _probes(hc: dict[str, Any], ep: BalancerEndpoint) -> bool:
        """Does this health check probe this balancer the way we need?"""
        c = hc.get("HealthCheckConfig", {})
        return (
            c.get("Type") == "HTTP" and c.get("IPAddress") == ep.ip and c.get("Port") == ep.port
            and c.get("ResourcePath", "/") == ep.health_path and not c.get("Inverted", False)
            and not c.get("Disabled", False)
        )

    # ------------------------------------------------------------------ desired state

    def _set_id(self, ep: BalancerEndpoint) -> str:
        return f"{SET_ID_PREFIX}{ep.region}"

    def desired_records(self, endpoints: list[BalancerEndpoint], checks: dict[str, str]) -> dict[str, dict[str, Any]]:
        recs: dict[str, dict[str, Any]] = {}
        if self.failover:
            ordered = sorted(endpoints, key=lambda e: not e.healthy)  # stable: config order among equals
            for role, ep in zip(("PRIMARY", "SECONDARY"), ordered, strict=False):
                recs[self._set_id(ep)] = {
                    "Name": self.record_name, "Type": "A", "SetIdentifier": self._set_id(ep), "Failover": role,
                    "TTL": self.ttl, "ResourceRecords": [{"Value": ep.ip}], "HealthCheckId": checks[ep.region],
                }
            return recs
        published = [e for e in endpoints if e.healthy]
        if endpoints and not published:
            log.warning("controller sees no live balancer; publishing all and leaving it to Route53 health checks")
            published = endpoints
        for ep in published:
            recs[self._set_id(ep)] = {
                "Name": self.record_name, "Type": "A", "SetIdentifier": self._set_id(ep),
                "Region": ep.aws_region or ep.region, "TTL": self.ttl,
                "ResourceRecords": [{"Value": ep.ip}], "HealthCheckId": checks[ep.region],
            }
        return recs

    def _check_foreign(self, foreign: list[dict[str, Any]]) -> None:
        """AWS rejects mixing routing policies on one name and type, and a CNAME beside
        anything; refuse before sending rather than fail half-way on AWS."""
        want = "Failover" if self.failover else "Region"
        for rr in foreign:
            if rr["Type"] == "CNAME":
                raise Route53ValidationError(
                    f"{self.record_name} already has a CNAME record, which cannot coexist with the mesh's A records"
                )
            if rr["Type"] != "A":
                continue
            policy = routing_policy(rr)
            if policy != want:
                what = "simple" if policy == "simple" else f"{policy}-policy"
                sid = f" {rr['SetIdentifier']!r}" if "SetIdentifier" in rr else ""
                raise Route53ValidationError(
                    f"{self.record_name} already has a {what} A record{sid} that skymesh does not manage; "
                    f"AWS rejects mixing routing policies on one name (remove it or pick another dns.name)"
                )

    # ------------------------------------------------------------------ sync

    def sync_blocking(self, endpoints: list[BalancerEndpoint]) -> bool:
        validate_endpoints(endpoints, self.failover)
        zone = self.zone_id()
        name_sets = self.name_record_sets()
        existing = {rr["SetIdentifier"]: rr for rr in name_sets if self._ours(rr)}
        foreign = [rr for rr in name_sets if not self._ours(rr)]
        self._check_foreign(foreign)

        changed = False
        all_checks = self.all_health_checks()
        by_id = {hc["Id"]: hc for hc in all_checks}
        check_ids: dict[str, str] = {}
        for ep in endpoints:
            hc = self._pick_check(ep, existing.get(self._set_id(ep)), by_id, all_checks)
            if hc is None:
                hc = self._create_check(ep)
                all_checks.append(hc)
                by_id[hc["Id"]] = hc
                changed = True
            check_ids[ep.region] = hc["Id"]

        desired = self.desired_records(endpoints, check_ids)
        validate_record_sets(self.record_name, [*[rr for rr in foreign if rr["Type"] == "A"], *desired.values()])
        changes: list[dict[str, Any]] = []
        for sid, rr in existing.items():
            want = desired.get(sid)
            # a failover role swap is DELETE + re-create in the same (atomic) batch: two
            # UPSERTs that swap PRIMARY and SECONDARY are reported to be refused by AWS
            if (want is None or routing_policy(want) != routing_policy(rr)
                    or want.get("Failover") != rr.get("Failover")):
                changes.append({"Action": "DELETE", "ResourceRecordSet": rr})
        for sid, rr in desired.items():
            have = existing.get(sid)
            # UPSERT also for new ones: the emulator's CREATE ignores SetIdentifier
            if have is None or routing_policy(have) != routing_policy(rr) or not _same_record(have, rr):
                changes.append({"Action": "UPSERT", "ResourceRecordSet": rr})
        if changes:
            resp = self.client.change_resource_record_sets(
                HostedZoneId=zone,
                ChangeBatch={"Comment": "skymesh controller sync", "Changes": changes},
            )
            self.changes_sent += 1
            changed = True
            log.info("route53 change sent", extra={"changes": [
                f"{c['Action']} {c['ResourceRecordSet']['SetIdentifier']}" for c in changes]})
            if self.wait_insync:
                self._wait_insync(resp["ChangeInfo"]["Id"])

        # owned checks no longer bound to a balancer (it left, or moved), after the records
        in_use = set(check_ids.values())
        for hc in all_checks:
            if self._owned_region_key(hc) is not None and hc["Id"] not in in_use:
                self.client.delete_health_check(HealthCheckId=hc["Id"])
                changed = True
        return changed

    def _pick_check(
        self, ep: BalancerEndpoint, record: dict[str, Any] | None, by_id: dict[str, dict[str, Any]],
        all_checks: list[dict[str, Any]],
    ) -> dict[str, Any] | None:
        """The existing check to bind: the one the record already uses, else one we own
        for this region, else any (e.g. terraform's) that probes this balancer."""
        if record is not None:
            bound = by_id.get(record.get("HealthCheckId", ""))
            if bound is not None and self._probes(bound, ep):
                return bound
        matching = [hc for hc in all_checks if self._probes(hc, ep)]
        key = self._region_key(ep.region)
        for hc in matching:
            if self._owned_region_key(hc) == key:
                return hc
        for hc in matching:  # not another mesh's check: that one may be deleted under us
            if not str(hc.get("CallerReference", "")).startswith(SET_ID_PREFIX):
                return hc
        return None

    def _create_check(self, ep: BalancerEndpoint) -> dict[str, Any]:
        resp = self.client.create_health_check(
            CallerReference=self._new_caller_reference(ep), HealthCheckConfig=self._check_config(ep)
        )
        hc: dict[str, Any] = resp["HealthCheck"]
        self.client.change_tags_for_resource(
            ResourceType="healthcheck", ResourceId=hc["Id"],
            AddTags=[{"Key": "Name", "Value": f"skymesh {ep.region} {self.record_name}"},
                     {"Key": "skymesh:region", "Value": ep.region},
                     {"Key": "skymesh:record", "Value": self.record_name}],
        )
        log.info("route53 health check created", extra={"region": ep.region, "id": hc["Id"]})
        return hc

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


def _same_record(have: dict[str, Any], want: dict[str, Any]) -> bool:
    keys = ("Type", "TTL", "Region", "Failover", "HealthCheckId")
    if any(have.get(k) != want.get(k) for k in keys):
        return False
    return sorted(r["Value"] for r in have.get("ResourceRecords", [])) == sorted(
        r["Value"] for r in want["ResourceRecords"]
    )
