"""Route53 provider against moto: records, health checks, idempotence, validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import boto3
import pytest
from moto import mock_aws

from skymesh.dns.base import BalancerEndpoint
from skymesh.dns.route53 import Route53Provider, Route53ValidationError

ZONE = "example.com"
NAME = "llm.example.com"
EPS = [
    BalancerEndpoint("us-east-1", "b1", "3.80.0.10", 8000, True),
    BalancerEndpoint("eu-west-1", "b2", "52.16.0.10", 8000, True),
    BalancerEndpoint("ap-northeast-1", "b3", "13.112.0.10", 8000, True),
]


@pytest.fixture
def r53(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    with mock_aws():
        client = boto3.client("route53", region_name="us-east-1")
        client.create_hosted_zone(Name=ZONE, CallerReference="zone-1")
        yield client


def provider(client: object, **kw: object) -> Route53Provider:
    return Route53Provider(ZONE, NAME, ttl=5, client=client, **kw)  # type: ignore[arg-type]


def records(client, p: Route53Provider) -> dict[str, dict]:  # noqa: ANN001
    return p.record_sets()


async def test_sync_creates_latency_records_bound_to_health_checks(r53) -> None:  # noqa: ANN001
    p = provider(r53)
    assert await p.sync(EPS) is True
    recs = records(r53, p)
    assert set(recs) == {"skymesh-us-east-1", "skymesh-eu-west-1", "skymesh-ap-northeast-1"}
    checks = p.health_checks()
    for ep in EPS:
        rec = recs[f"skymesh-{ep.region}"]
        assert rec["Region"] == ep.region and rec["TTL"] == 5
        assert rec["ResourceRecords"] == [{"Value": ep.ip}]
        assert rec["HealthCheckId"] == checks[ep.region]["Id"]
        cfg = checks[ep.region]["HealthCheckConfig"]
        assert (cfg["IPAddress"], cfg["Port"], cfg["ResourcePath"], cfg["Type"]) == (ep.ip, 8000, "/health", "HTTP")


async def test_sync_is_idempotent(r53) -> None:  # noqa: ANN001
    p = provider(r53)
    await p.sync(EPS)
    sent = p.changes_sent
    assert await p.sync(EPS) is False
    assert p.changes_sent == sent
    # a fresh provider (a restarted controller) finds everything and changes nothing
    assert await provider(r53).sync(EPS) is False


async def test_dead_balancer_loses_its_record_and_gets_it_back(r53) -> None:  # noqa: ANN001
    p = provider(r53)
    await p.sync(EPS)
    down = [dataclasses.replace(e, healthy=e.region != "eu-west-1") for e in EPS]
    assert await p.sync(down) is True
    assert "skymesh-eu-west-1" not in records(r53, p)
    assert "eu-west-1" in p.health_checks()  # the check stays for the recovery
    assert await p.sync(EPS) is True
    assert "skymesh-eu-west-1" in records(r53, p)


async def test_removed_balancer_record_and_check_are_deleted(r53) -> None:  # noqa: ANN001
    p = provider(r53)
    await p.sync(EPS)
    assert await p.sync(EPS[:2]) is True
    assert set(records(r53, p)) == {"skymesh-us-east-1", "skymesh-eu-west-1"}
    assert set(p.health_checks()) == {"us-east-1", "eu-west-1"}


async def test_moved_balancer_gets_a_new_health_check(r53) -> None:  # noqa: ANN001
    p = provider(r53)
    await p.sync(EPS)
    old = p.health_checks()["us-east-1"]["Id"]
    moved = [dataclasses.replace(EPS[0], ip="3.80.0.99"), *EPS[1:]]
    await p.sync(moved)
    new = p.health_checks()["us-east-1"]["Id"]
    assert new != old
    assert records(r53, p)["skymesh-us-east-1"]["HealthCheckId"] == new


@pytest.mark.parametrize(("bad", "message"), [
    (dataclasses.replace(EPS[0], ip="10.0.0.5"), "not a public address"),
    (dataclasses.replace(EPS[0], ip="not-an-ip"), "not an IP address"),
    (dataclasses.replace(EPS[0], ip="2600::1"), "not IPv4"),
    (dataclasses.replace(EPS[0], region="mars-1"), "not a Route53 latency region"),
    (dataclasses.replace(EPS[0], port=0), "port 0"),
    (dataclasses.replace(EPS[0], region="eu-west-1"), "duplicate regions"),
])
async def test_validation_rejects_what_aws_would(r53, bad: BalancerEndpoint, message: str) -> None:  # noqa: ANN001
    p = provider(r53)
    with pytest.raises(Route53ValidationError, match=message):
        await p.sync([bad, *EPS[1:]])
    assert records(r53, p) == {}  # nothing was sent


async def test_refuses_to_mix_routing_policies(r53) -> None:  # noqa: ANN001
    zone_id = provider(r53).zone_id()
    r53.change_resource_record_sets(HostedZoneId=zone_id, ChangeBatch={"Changes": [{
        "Action": "CREATE", "ResourceRecordSet": {"Name": NAME, "Type": "A", "TTL": 60,
                                                  "ResourceRecords": [{"Value": "3.3.3.3"}]}}]})
    with pytest.raises(Route53ValidationError, match="simple A record"):
        await provider(r53).sync(EPS)


async def test_failover_mode_primary_secondary(r53) -> None:  # noqa: ANN001
    p = provider(r53, failover=True)
    with pytest.raises(Route53ValidationError, match="exactly 2"):
        await p.sync(EPS)
    await p.sync(EPS[:2])
    recs = records(r53, p)
    assert recs["skymesh-us-east-1"]["Failover"] == "PRIMARY"
    assert recs["skymesh-eu-west-1"]["Failover"] == "SECONDARY"
    await p.sync([dataclasses.replace(EPS[0], healthy=False), EPS[1]])
    recs = records(r53, p)
    assert recs["skymesh-eu-west-1"]["Failover"] == "PRIMARY"


def test_record_outside_zone_is_rejected() -> None:
    with pytest.raises(Route53ValidationError, match="not inside zone"):
        Route53Provider(ZONE, "llm.other.org", client=object())
