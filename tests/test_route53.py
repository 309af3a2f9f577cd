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
    sent: list[list[tuple[str, str, str]]] = []

    def capture(params: dict, **_kw: object) -> None:
        sent.append([(c["Action"], c["ResourceRecordSet"]["SetIdentifier"],
                      c["ResourceRecordSet"].get("Failover", "")) for c in params["ChangeBatch"]["Changes"]])

    r53.meta.events.register("provide-client-params.route53.ChangeResourceRecordSets", capture)
    await p.sync([dataclasses.replace(EPS[0], healthy=False), EPS[1]])
    recs = records(r53, p)
    assert recs["skymesh-eu-west-1"]["Failover"] == "PRIMARY"
    assert recs["skymesh-us-east-1"]["Failover"] == "SECONDARY"
    # the role swap is one atomic batch: both old records deleted, then both re-created
    assert len(sent) == 1
    assert sorted(c for c in sent[0] if c[0] == "DELETE") == [
        ("DELETE", "skymesh-eu-west-1", "SECONDARY"), ("DELETE", "skymesh-us-east-1", "PRIMARY")]
    assert [c[0] for c in sent[0]] == ["DELETE", "DELETE", "UPSERT", "UPSERT"]


def test_record_outside_zone_is_rejected() -> None:
    with pytest.raises(Route53ValidationError, match="not inside zone"):
        Route53Provider(ZONE, "llm.other.org", client=object())


def test_record_in_a_lookalike_zone_is_rejected() -> None:
    with pytest.raises(Route53ValidationError, match="not inside zone"):
        Route53Provider(ZONE, "llm.notexample.com", client=object())


async def test_missing_zone_is_a_clear_error(r53) -> None:  # noqa: ANN001
    with pytest.raises(LookupError, match="no public hosted zone named other.org."):
        await Route53Provider("other.org", "llm.other.org", client=r53).sync(EPS)


async def test_caller_references_fit_aws_limits_and_are_never_reused(r53) -> None:  # noqa: ANN001
    long_zone = "a-rather-long-subdomain-name-for-a-mesh.example.com"
    r53.create_hosted_zone(Name=long_zone, CallerReference="zone-2")
    p = Route53Provider(long_zone, f"inference-endpoint.{long_zone}", client=r53)
    await p.sync(EPS)
    refs = {hc["CallerReference"] for hc in p.all_health_checks()}
    assert len(refs) == 3 and all(len(r) <= 64 for r in refs)
    assert set(p.health_checks()) == {e.region for e in EPS}  # found again by the stable prefix
    # a balancer that leaves and comes back gets a new reference (AWS refuses a deleted one's)
    await p.sync(EPS[1:])
    await p.sync(EPS)
    assert p.health_checks()["us-east-1"]["CallerReference"] not in refs


async def test_long_region_names_are_hashed_into_the_reference(r53) -> None:  # noqa: ANN001
    ep = dataclasses.replace(EPS[0], region="us-east-1-" + "x" * 50, aws_region="us-east-1")
    p = provider(r53)
    await p.sync([ep, *EPS[1:]])
    ref = next(hc["CallerReference"] for hc in p.all_health_checks() if hc["HealthCheckConfig"]["IPAddress"] == ep.ip)
    assert len(ref) <= 64
    assert await p.sync([ep, *EPS[1:]]) is False


async def test_adopts_health_checks_and_records_made_by_terraform(r53) -> None:  # noqa: ANN001
    """The dns module creates checks with its own CallerReference and the same record
    scheme: the controller binds to them and sends nothing, so the two never fight."""
    zone_id = provider(r53).zone_id()
    changes = []
    for i, ep in enumerate(EPS):
        hc = r53.create_health_check(CallerReference=f"terraform-{i}", HealthCheckConfig={
            "IPAddress": ep.ip, "Port": ep.port, "Type": "HTTP", "ResourcePath": "/health",
            "RequestInterval": 10, "FailureThreshold": 3})["HealthCheck"]
        changes.append({"Action": "CREATE", "ResourceRecordSet": {
            "Name": NAME + ".", "Type": "A", "SetIdentifier": f"skymesh-{ep.region}", "Region": ep.region,
            "TTL": 5, "ResourceRecords": [{"Value": ep.ip}], "HealthCheckId": hc["Id"]}})
    r53.change_resource_record_sets(HostedZoneId=zone_id, ChangeBatch={"Changes": changes})
    p = provider(r53)
    assert await p.sync(EPS) is False
    assert p.changes_sent == 0 and p.health_checks() == {}  # nothing created, nothing owned
    # a dead region loses its record; the terraform check is neither deleted nor replaced
    down = [dataclasses.replace(e, healthy=e.region != "eu-west-1") for e in EPS]
    assert await p.sync(down) is True
    assert len(p.all_health_checks()) == 3
    assert await p.sync(EPS) is True
    assert p.health_checks() == {}  # the recovered record binds the terraform check again


async def test_controller_seeing_every_balancer_dead_leaves_it_to_route53(r53) -> None:  # noqa: ANN001
    p = provider(r53)
    await p.sync(EPS)
    assert await p.sync([dataclasses.replace(e, healthy=False) for e in EPS]) is False
    assert len(records(r53, p)) == 3


async def test_switching_to_failover_mode_replaces_latency_records(r53) -> None:  # noqa: ANN001
    await provider(r53).sync(EPS[:2])
    p = provider(r53, failover=True)
    assert await p.sync(EPS[:2]) is True
    recs = records(r53, p)
    assert {r.get("Failover") for r in recs.values()} == {"PRIMARY", "SECONDARY"}
    assert all("Region" not in r for r in recs.values())
    assert await p.sync(EPS[:2]) is False


async def test_only_the_mesh_name_is_touched(r53) -> None:  # noqa: ANN001
    zone_id = provider(r53).zone_id()
    others = [{"Action": "CREATE", "ResourceRecordSet": {"Name": n, "Type": t, "TTL": 60,
                                                          "ResourceRecords": [{"Value": v}]}}
              for n, t, v in [("a.example.com", "A", "3.3.3.3"), ("zz.example.com", "A", "4.4.4.4"),
                              ("llm.example.com", "TXT", '"owner=ops"'), ("x.llm.example.com", "A", "5.5.5.5")]]
    r53.change_resource_record_sets(HostedZoneId=zone_id, ChangeBatch={"Changes": others})
    p = provider(r53)
    await p.sync(EPS)
    await p.sync(EPS[:1])
    sets = r53.list_resource_record_sets(HostedZoneId=zone_id)["ResourceRecordSets"]
    names = {(r["Name"], r["Type"]) for r in sets if "SetIdentifier" not in r}
    assert {("a.example.com.", "A"), ("zz.example.com.", "A"), ("llm.example.com.", "TXT"),
            ("x.llm.example.com.", "A")} <= names
    assert set(records(r53, p)) == {"skymesh-us-east-1"}


async def test_concurrent_syncs_are_serialised(r53) -> None:  # noqa: ANN001
    import asyncio

    p = provider(r53)
    results = await asyncio.gather(p.sync(EPS), p.sync(EPS), p.sync(EPS))
    assert sorted(results) == [False, False, True]
    assert len(p.all_health_checks()) == 3


def rr(sid: str, **kw: object) -> dict:
    base = {"Name": "llm.example.com.", "Type": "A", "SetIdentifier": sid, "Region": "us-east-1", "TTL": 5,
            "ResourceRecords": [{"Value": "3.80.0.10"}], "HealthCheckId": "abc"}
    base.update(kw)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize(("sets", "message"), [
    ([rr("a"), rr("b", Region=None, Failover="PRIMARY")], "must not be mixed"),
    ([rr("a"), rr("a", Region="eu-west-1")], "SetIdentifier used twice"),
    ([rr("x" * 129)], "SetIdentifier must be 1-128"),
    ([rr("a", TTL=-1)], "TTL -1"),
    ([rr("a", TTL=2**31)], "TTL 2147483648"),
    ([rr("a", ResourceRecords=[{"Value": "3.80.0"}])], "not an IPv4"),
    ([rr("a", ResourceRecords=[{"Value": "::1"}])], "not an IPv4"),
    ([rr("a", Region="moon-1")], "not a Route53 latency region"),
    ([rr("a", Type="AAAA")], "A record"),
    ([rr("a", Region=None, Failover="PRIMARY"), rr("b", Region=None, Failover="PRIMARY")], "one PRIMARY"),
    ([rr("a", Region=None, Failover="TERTIARY")], "PRIMARY or SECONDARY"),
])
def test_record_set_validation(sets: list[dict], message: str) -> None:
    from skymesh.dns.route53_validate import validate_record_sets

    with pytest.raises(Route53ValidationError, match=message):
        validate_record_sets("llm.example.com.", sets)


def test_latency_regions_come_from_the_service_model() -> None:
    from skymesh.dns.route53_validate import latency_regions

    assert {"us-east-1", "eu-west-1", "ap-northeast-1", "sa-east-1"} <= latency_regions()
    assert "mars-1" not in latency_regions() and "local" not in latency_regions()
