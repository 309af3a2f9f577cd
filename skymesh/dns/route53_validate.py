"""Local validation of what the Route53 provider is about to send.

An emulator (moto) accepts record sets that AWS rejects: unknown latency regions, routing
policies mixed on one name, non-IPv4 values in ``A`` records, out-of-range TTLs, clashing
or over-long ``SetIdentifier``\\ s, private addresses in health checks. These checks run on
the *final* desired state before any API call, so a bad config fails with a message that
names the balancer and the fix instead of half-applying a change batch on AWS.

The limits come from botocore's Route53 service model (the same model the API enforces),
so the list of latency regions follows the installed botocore.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterable
from functools import cache
from typing import Any

import botocore.session

from skymesh.dns.base import BalancerEndpoint

ROUTING_KEYS = ("Region", "Failover", "Weight", "GeoLocation", "GeoProximityLocation", "CidrRoutingConfig",
                "MultiValueAnswer")


class Route53ValidationError(ValueError):
    """A record set or health check AWS would reject; raised before anything is sent."""


@cache
def _limits() -> dict[str, Any]:
    model = botocore.session.get_session().get_service_model("route53")
    return {
        "regions": frozenset(model.shape_for("ResourceRecordSetRegion").enum),
        "set_id_max": model.shape_for("ResourceRecordSetIdentifier").metadata["max"],
        "ttl_max": model.shape_for("TTL").metadata["max"],
        "path_max": model.shape_for("ResourcePath").metadata["max"],
        "caller_ref_max": model.shape_for("HealthCheckNonce").metadata["max"],
    }


def latency_regions() -> frozenset[str]:
    """Region values Route53 accepts in latency records."""
    regions: frozenset[str] = _limits()["regions"]
    return regions


def caller_reference_max() -> int:
    n: int = _limits()["caller_ref_max"]
    return n


def routing_policy(rr: dict[str, Any]) -> str:
    """The routing policy of a record set: ``simple`` or the key that selects one."""
    for key in ROUTING_KEYS:
        if key in rr:
            return key
    return "simple"


def validate_endpoints(endpoints: Iterable[BalancerEndpoint], failover: bool) -> None:
    """Per-balancer checks: addresses health checks and A records accept."""
    eps = list(endpoints)
    dup = [r for r, n in Counter(e.region for e in eps).items() if n > 1]
    if dup:
        raise Route53ValidationError(f"duplicate regions {sorted(dup)}: one balancer per region")
    if failover and len(eps) != 2:
        raise Route53ValidationError(
            f"failover mode needs exactly 2 regions (PRIMARY and SECONDARY), got {len(eps)}"
        )
    for ep in eps:
        where = f"balancer {ep.region}"
        try:
            addr = ipaddress.ip_address(ep.ip)
        except ValueError:
            raise Route53ValidationError(f"{where}: {ep.ip!r} is not an IP address") from None
        if addr.version != 4:
            raise Route53ValidationError(f"{where}: {ep.ip} is not IPv4 (the mesh name is an A record)")
        if not addr.is_global:
            raise Route53ValidationError(
                f"{where}: {ep.ip} is not a public address; Route53 health checks and public "
                "records need one (set regions[].balancer.public_ip)"
            )
        if not 1 <= ep.port <= 65535:
            raise Route53ValidationError(f"{where}: port {ep.port} is invalid (1-65535)")
        if not ep.health_path.startswith("/") or len(ep.health_path) > _limits()["path_max"]:
            raise Route53ValidationError(
                f"{where}: health path {ep.health_path!r} must start with / and be at most "
                f"{_limits()['path_max']} characters"
            )
        if not failover:
            region = ep.aws_region or ep.region
            if region not in latency_regions():
                raise Route53ValidationError(
                    f"{where}: {region!r} is not a Route53 latency region; set regions[].aws_region "
                    "to the AWS region the balancer runs in"
                )


def validate_record_sets(name: str, record_sets: Iterable[dict[str, Any]]) -> None:
    """Checks on the complete set of record sets one name will carry after a change batch."""
    sets = list(record_sets)
    policies = {routing_policy(rr) for rr in sets}
    if len(policies) > 1:
        raise Route53ValidationError(f"{name}: routing policies must not be mixed on one name, got {sorted(policies)}")
    ids = Counter(rr.get("SetIdentifier") for rr in sets)
    clash = sorted(str(i) for i, n in ids.items() if n > 1)
    if clash:
        raise Route53ValidationError(f"{name}: SetIdentifier used twice: {clash}")
    failover_roles: list[str] = []
    for rr in sets:
        sid = rr.get("SetIdentifier")
        where = f"{name} [{sid}]"
        if rr.get("Name") != name:
            raise Route53ValidationError(f"{where}: record name {rr.get('Name')!r} is not {name!r}")
        if rr.get("Type") != "A":
            raise Route53ValidationError(f"{where}: type {rr.get('Type')!r}, the mesh name is an A record")
        if policies != {"simple"} and not (isinstance(sid, str) and 1 <= len(sid) <= _limits()["set_id_max"]):
            raise Route53ValidationError(
                f"{where}: SetIdentifier must be 1-{_limits()['set_id_max']} characters"
            )
        ttl = rr.get("TTL")
        if not isinstance(ttl, int) or not 0 <= ttl <= _limits()["ttl_max"]:
            raise Route53ValidationError(f"{where}: TTL {ttl!r} is outside 0..{_limits()['ttl_max']}")
        values = [v.get("Value") for v in rr.get("ResourceRecords", [])]
        if not values:
            raise Route53ValidationError(f"{where}: no values")
        for v in values:
            try:
                ok = ipaddress.ip_address(v).version == 4
            except ValueError:
                ok = False
            if not ok:
                raise Route53ValidationError(f"{where}: {v!r} is not an IPv4 address (A record)")
        if "Region" in rr and rr["Region"] not in latency_regions():
            raise Route53ValidationError(f"{where}: {rr['Region']!r} is not a Route53 latency region")
        if "Failover" in rr:
            if rr["Failover"] not in ("PRIMARY", "SECONDARY"):
                raise Route53ValidationError(f"{where}: Failover must be PRIMARY or SECONDARY")
            failover_roles.append(rr["Failover"])
        hc = rr.get("HealthCheckId")
        if hc is not None and (not isinstance(hc, str) or not hc):
            raise Route53ValidationError(f"{where}: HealthCheckId must be a health check id")
    if failover_roles and sorted(failover_roles) not in (["PRIMARY"], ["PRIMARY", "SECONDARY"], ["SECONDARY"]):
        raise Route53ValidationError(f"{name}: failover needs one PRIMARY and at most one SECONDARY, got {failover_roles}")
