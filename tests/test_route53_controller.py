"""The controller as its own process keeps Route53 (a moto server on loopback) true."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import boto3
import pytest
import yaml
from aiohttp import web

from skymesh.runtime.procs import Child, skymesh_cmd
from tests.mesh_helpers import local_config_free_ports

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
PUBLIC = {"us-east-1": "3.80.0.10", "eu-west-1": "52.16.0.10", "ap-northeast-1": "13.112.0.10"}




async def fake_balancer(host: str, port: int) -> web.AppRunner:
    """Only /health: the controller judges liveness by it (this tests the controller)."""
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def latency_records(client, zone_id: str) -> dict[str, dict]:  # noqa: ANN001
    sets = client.list_resource_record_sets(HostedZoneId=zone_id)["ResourceRecordSets"]
    return {r["SetIdentifier"]: r for r in sets if r.get("SetIdentifier", "").startswith("skymesh-")}


async def wait_until(pred, within_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(pred):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(what)


def route53_mesh_config(tmp_path: Path, moto_url: str, regions: tuple[str, ...], routing: str) -> dict:
    cfg = local_config_free_ports()
    cfg["emulate_latency"] = False
    cfg["regions"] = [r for r in cfg["regions"] if r["name"] in regions]
    cfg["latencies"] = [e for e in cfg["latencies"] if set(e["regions"]) <= set(regions)]
    for r in cfg["regions"]:
        r["balancer"].pop("advertise")
        r["balancer"].pop("grpc_advertise")
        r["balancer"]["public_ip"] = PUBLIC[r["name"]]
        r["aws_region"] = r["name"]
    cfg["dns"] = {"name": "llm.example.com", "provider": "route53", "hosted_zone": "example.com",
                  "endpoint_url": moto_url, "ttl_s": 5, "routing": routing}
    cfg["controller"].update(state_path=str(tmp_path / "ctl.sqlite"), probe_interval_s=0.3, failure_threshold=2)
    return cfg


def listen_of(cfg: dict, region: str) -> tuple[str, int]:
    host, port = next(r for r in cfg["regions"] if r["name"] == region)["balancer"]["listen"].rsplit(":", 1)
    return host, int(port)


async def start_controller(cfg: dict, tmp_path: Path) -> Child:
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # nobody here dials the controller: it may listen anywhere (port 0, reported)
    ctl = Child("controller", skymesh_cmd("controller", "--config", str(path), "--grpc-port", "0",
                                          "--http-port", "0"), tmp_path, env=dict(os.environ))
    ctl.start()
    try:
        await ctl.wait_ready(within_s=30)
    except BaseException:
        await ctl.stop()
        raise
    return ctl


async def test_controller_process_moves_route53_records_on_balancer_death(tmp_path: Path, moto_url: str) -> None:
    client = boto3.client("route53", endpoint_url=moto_url, region_name="us-east-1")
    zone_id = client.create_hosted_zone(Name="example.com", CallerReference="z1")["HostedZone"]["Id"].split("/")[-1]
    cfg = route53_mesh_config(tmp_path, moto_url, tuple(PUBLIC), "latency")
    runners = {r["name"]: await fake_balancer(*listen_of(cfg, r["name"])) for r in cfg["regions"]}
    ctl: Child | None = None
    try:
        ctl = await start_controller(cfg, tmp_path)
        await wait_until(lambda: len(latency_records(client, zone_id)) == 3, 30, "3 latency records")
        recs = latency_records(client, zone_id)
        checks = {hc["Id"]: hc for hc in client.list_health_checks()["HealthChecks"]}
        for region, ip in PUBLIC.items():
            rec = recs[f"skymesh-{region}"]
            assert rec["Region"] == region and rec["ResourceRecords"] == [{"Value": ip}]
            assert checks[rec["HealthCheckId"]]["HealthCheckConfig"]["IPAddress"] == ip
        await runners.pop("eu-west-1").cleanup()  # the eu balancer dies
        await wait_until(lambda: "skymesh-eu-west-1" not in latency_records(client, zone_id), 15,
                         "eu-west-1 record removed")
        remaining = latency_records(client, zone_id)
        assert set(remaining) == {"skymesh-us-east-1", "skymesh-ap-northeast-1"}
        assert all(r["HealthCheckId"] in checks for r in remaining.values())
        # it comes back: so does its record, bound to the same health check
        runners["eu-west-1"] = await fake_balancer(*listen_of(cfg, "eu-west-1"))
        await wait_until(lambda: "skymesh-eu-west-1" in latency_records(client, zone_id), 15,
                         "eu-west-1 record back")
        assert latency_records(client, zone_id)["skymesh-eu-west-1"]["HealthCheckId"] == recs["skymesh-eu-west-1"]["HealthCheckId"]
    finally:
        if ctl is not None:
            await ctl.stop()
        for runner in runners.values():
            await runner.cleanup()


async def test_controller_process_failover_routing_swaps_primary(tmp_path: Path, moto_url: str) -> None:
    """dns.routing: failover (two regions): PRIMARY follows the controller's view."""
    client = boto3.client("route53", endpoint_url=moto_url, region_name="us-east-1")
    zone_id = client.create_hosted_zone(Name="example.com", CallerReference="z2")["HostedZone"]["Id"].split("/")[-1]
    cfg = route53_mesh_config(tmp_path, moto_url, ("us-east-1", "eu-west-1"), "failover")
    runners = {r["name"]: await fake_balancer(*listen_of(cfg, r["name"])) for r in cfg["regions"]}

    def roles() -> dict[str, str]:
        return {sid: r.get("Failover", "") for sid, r in latency_records(client, zone_id).items()}

    ctl: Child | None = None
    try:
        ctl = await start_controller(cfg, tmp_path)
        await wait_until(lambda: roles() == {"skymesh-us-east-1": "PRIMARY", "skymesh-eu-west-1": "SECONDARY"},
                         30, "us-east-1 PRIMARY, eu-west-1 SECONDARY")
        recs = latency_records(client, zone_id)
        assert all("Region" not in r and r["HealthCheckId"] for r in recs.values())
        await runners.pop("us-east-1").cleanup()  # the primary's balancer dies
        await wait_until(lambda: roles() == {"skymesh-us-east-1": "SECONDARY", "skymesh-eu-west-1": "PRIMARY"},
                         15, "eu-west-1 promoted to PRIMARY")
        # both records stay published, each bound to its own balancer's check
        after = latency_records(client, zone_id)
        assert {sid: r["HealthCheckId"] for sid, r in after.items()} == {
            sid: r["HealthCheckId"] for sid, r in recs.items()}
    finally:
        if ctl is not None:
            await ctl.stop()
        for runner in runners.values():
            await runner.cleanup()
