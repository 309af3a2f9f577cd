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

from skymesh.procs import Child, skymesh_cmd, wait_healthy
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


async def test_controller_process_moves_route53_records_on_balancer_death(tmp_path: Path, moto_url: str) -> None:
    client = boto3.client("route53", endpoint_url=moto_url, region_name="us-east-1")
    zone_id = client.create_hosted_zone(Name="example.com", CallerReference="z1")["HostedZone"]["Id"].split("/")[-1]
    cfg = local_config_free_ports()
    cfg["emulate_latency"] = False
    for r in cfg["regions"]:
        r["balancer"].pop("advertise")
        r["balancer"].pop("grpc_advertise")
        r["balancer"]["public_ip"] = PUBLIC[r["name"]]
        r["aws_region"] = r["name"]
    cfg["dns"] = {"name": "llm.example.com", "provider": "route53", "hosted_zone": "example.com",
                  "endpoint_url": moto_url, "ttl_s": 5}
    cfg["controller"].update(state_path=str(tmp_path / "ctl.sqlite"), probe_interval_s=0.3, failure_threshold=2)
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    runners = {}
    for r in cfg["regions"]:
        host, port = r["balancer"]["listen"].rsplit(":", 1)
        runners[r["name"]] = await fake_balancer(host, int(port))
    ctl = Child("controller", skymesh_cmd("controller", "--config", str(path)), tmp_path, env=dict(os.environ))
    ctl.start()
    try:
        host, port = cfg["controller"]["http_listen"].rsplit(":", 1)
        await wait_healthy(f"http://{host}:{port}/health", ctl, within_s=30)
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
        host, port = next(r for r in cfg["regions"] if r["name"] == "eu-west-1")["balancer"]["listen"].rsplit(":", 1)
        runners["eu-west-1"] = await fake_balancer(host, int(port))
        await wait_until(lambda: "skymesh-eu-west-1" in latency_records(client, zone_id), 15,
                         "eu-west-1 record back")
        assert latency_records(client, zone_id)["skymesh-eu-west-1"]["HealthCheckId"] == recs["skymesh-eu-west-1"]["HealthCheckId"]
    finally:
        await ctl.stop()
        for runner in runners.values():
            await runner.cleanup()
