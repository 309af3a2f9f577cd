"""The region's autoscaling signal (predicted seconds of prefill waiting per healthy
replica) computed from a region core, and its publisher: PutMetricData against moto's
CloudWatch in-process, off the event loop, surviving a failing CloudWatch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import boto3
import pytest
import yaml
from moto import mock_aws

from skymesh.balancer.autoscaling_signal import (
    LOOP_NAME,
    CloudWatchClient,
    CloudWatchSignal,
    attach_autoscaling_signal,
    pending_prefill_s_per_replica,
)
from skymesh.config import CloudWatchSignalConfig, ConfigError, parse_config
from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.health import ProbeSample
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import SendToReplica
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy
from skymesh.runtime.procs import Child, free_port, skymesh_cmd
from tests.mesh_helpers import ROOT, one_region_config

HANG_GUARD_S = 60.0  # a hang guard only: the test waits for events, not for time

# 1 ms of prefill per prompt token: round numbers below
S_PER_TOKEN = 1e-3


def region_core(n: int) -> RegionCore:
    model = RegionModel(prefill_s_per_token=S_PER_TOKEN)
    core = RegionCore("here", make_policy("least_load", PolicyContext(model=model)),
                      OffloadRouter("here", {}, enabled=False), RegionSettings(), model)
    core.set_replicas([f"r{i}" for i in range(n)], 0.0)
    for rid in list(core.view.replicas):
        core.probe(rid, ProbeSample(), 0.0)
    return core


def req(i: int, tokens: int) -> RoutingRequest:
    text = " ".join(f"q{i}w{k}" for k in range(tokens))
    return RoutingRequest(f"q{i}", prompt_chunk_hashes(text, 64), tokens, 0.0)


def eject(core: RegionCore, replica_id: str) -> None:
    before = core.view.ejected_count()
    for _ in range(20):  # failed probes until the health tracker ejects it
        core.probe(replica_id, None, 0.0)
        if core.view.ejected_count() > before:
            return
    raise AssertionError(f"{replica_id} was never ejected")


def test_signal_is_pending_prefill_seconds_per_healthy_replica() -> None:
    core = region_core(3)
    assert pending_prefill_s_per_replica(core) == 0.0
    for i, tokens in enumerate((600, 900, 1500)):
        core.submit(req(i, tokens), 0.0)
    # queued: 3000 tokens at 1 ms each, over 3 healthy replicas
    assert pending_prefill_s_per_replica(core) == pytest.approx(1.0)
    placed = {a.request_id for a in core.tick(0.0) if isinstance(a, SendToReplica)}
    assert placed  # dispatched without a first token: still waiting prefill work
    assert pending_prefill_s_per_replica(core) == pytest.approx(1.0)
    core.first_token("q2", 0.5, observe=False)  # its 1500 tokens are prefilled
    assert pending_prefill_s_per_replica(core) == pytest.approx(0.5)
    eject(core, "r0")  # what it held unstarted is queued again: the same work waits
    # the same work over the two replicas still healthy
    assert pending_prefill_s_per_replica(core) == pytest.approx(0.75)


def test_a_region_without_healthy_replicas_counts_all_its_work() -> None:
    core = region_core(1)
    core.submit(req(0, 2000), 0.0)
    eject(core, "r0")
    assert pending_prefill_s_per_replica(core) == pytest.approx(2.0)


def test_the_signal_follows_the_refitted_ttft_model() -> None:
    core = region_core(2)
    core.submit(req(0, 1000), 0.0)
    core.model.estimator.s_per_token = 2e-3  # what observe() does after slower prefills
    assert pending_prefill_s_per_replica(core) == pytest.approx(1.0)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "eu-west-1"}.items():
        monkeypatch.setenv(k, v)
    with mock_aws():
        yield


def datapoints(namespace: str, metric: str, region: str) -> list[dict[str, Any]]:
    cw = boto3.client("cloudwatch", region_name="eu-west-1")
    now = datetime.now(UTC)
    out = cw.get_metric_statistics(Namespace=namespace, MetricName=metric,
                                   Dimensions=[{"Name": "Region", "Value": region}],
                                   StartTime=now - timedelta(hours=1), EndTime=now + timedelta(hours=1),
                                   Period=60, Statistics=["Maximum", "SampleCount"])
    points: list[dict[str, Any]] = out["Datapoints"]
    return points


def test_a_data_point_lands_in_cloudwatch_with_namespace_dimension_and_value(aws_env: None) -> None:
    core = region_core(2)
    core.submit(req(0, 1500), 0.0)  # 1.5 s of prefill over 2 replicas
    cfg = CloudWatchSignalConfig(namespace="SkyMesh", metric_name="PendingPrefillSecondsPerReplica")
    threads: list[int] = []

    def client() -> CloudWatchClient:
        threads.append(threading.get_ident())
        c: CloudWatchClient = boto3.client("cloudwatch", region_name="eu-west-1")
        return c

    svc = CloudWatchSignal("eu-west-1", cfg, lambda: pending_prefill_s_per_replica(core), client)

    async def main() -> tuple[float, int]:
        value = await svc.publish_once()
        return value, threading.get_ident()

    value, loop_thread = asyncio.run(main())
    assert value == pytest.approx(0.75)
    # boto3 ran in a worker thread, never on the event loop's
    assert threads and threads[0] != loop_thread
    listed = boto3.client("cloudwatch", region_name="eu-west-1").list_metrics(Namespace="SkyMesh")["Metrics"]
    assert [(m["MetricName"], m["Dimensions"]) for m in listed] == [
        ("PendingPrefillSecondsPerReplica", [{"Name": "Region", "Value": "eu-west-1"}])]
    (point,) = datapoints("SkyMesh", "PendingPrefillSecondsPerReplica", "eu-west-1")
    assert point["Maximum"] == pytest.approx(0.75) and point["SampleCount"] == 1.0
    assert point["Unit"] == "Seconds"
    assert svc.published == 1 and svc.failed == 0


def test_the_supervised_loop_publishes_and_outlives_a_failing_cloudwatch(aws_env: None) -> None:
    core = region_core(1)
    core.submit(req(0, 400), 0.0)
    real = boto3.client("cloudwatch", region_name="eu-west-1")
    calls: list[str] = []

    class FlakyCloudWatch:
        """Throttled on the first put, then CloudWatch as usual."""

        def put_metric_data(self, **kwargs: Any) -> Any:
            calls.append(kwargs["Namespace"])
            if len(calls) == 1:
                raise RuntimeError("Throttling: Rate exceeded")
            return real.put_metric_data(**kwargs)

    published = asyncio.Event()

    class Observed(CloudWatchSignal):
        async def publish_once(self) -> float:
            value = await super().publish_once()
            published.set()
            return value

    svc = Observed("eu-west-1", CloudWatchSignalConfig(interval_s=1.0),
                   lambda: pending_prefill_s_per_replica(core), FlakyCloudWatch)

    async def main() -> None:
        await svc.start()
        try:
            await published.wait()  # the first put failed; the loop tried again
        finally:
            await svc.stop()

    asyncio.run(main())
    assert svc.failed == 1 and svc.published == 1 and calls[:2] == ["SkyMesh", "SkyMesh"]
    # a failed put is the loop's business, not a crash of it
    assert svc.loop_restarts.get(LOOP_NAME, 0) == 0
    (point,) = datapoints("SkyMesh", "PendingPrefillSecondsPerReplica", "eu-west-1")
    assert point["Maximum"] == pytest.approx(0.4)


def local_config(extra: dict[str, Any]) -> Any:
    doc = yaml.safe_load((ROOT / "skymesh" / "local.yaml").read_text())
    return parse_config({**doc, **extra})


def test_attached_only_when_configured_and_in_the_regions_aws_region() -> None:
    cfg = local_config({})
    region = cfg.regions[0].name
    stand_in = SimpleNamespace(region=region, cfg=cfg, core=region_core(1), extra_services=[])
    assert attach_autoscaling_signal(stand_in) is None and stand_in.extra_services == []

    cfg = local_config({"autoscaling": {"cloudwatch": {"namespace": "Mesh/Prod", "interval_s": 15}}})
    stand_in = SimpleNamespace(region=region, cfg=cfg, core=region_core(1), extra_services=[])
    made: list[str] = []

    def factory() -> CloudWatchClient:  # boto3's client is made at the first put, in its thread
        made.append("client")
        c: CloudWatchClient = boto3.client("cloudwatch", region_name="eu-west-1")
        return c

    svc = attach_autoscaling_signal(stand_in, factory)
    assert svc is not None and stand_in.extra_services == [svc]
    assert (svc.region, svc.cfg.namespace, svc.cfg.metric_name, svc.cfg.interval_s) == (
        region, "Mesh/Prod", "PendingPrefillSecondsPerReplica", 15.0)
    assert made == []


@pytest.mark.parametrize(("section", "path"), [
    ({"cloudwatch": {"namespace": "AWS/EC2"}}, "autoscaling.cloudwatch.namespace"),
    ({"cloudwatch": {"interval_s": 0.5}}, "autoscaling.cloudwatch.interval_s"),
    ({"cloudwatch": {"metric_name": "has space"}}, "autoscaling.cloudwatch.metric_name"),
    ({"cloudwatch": {"dimension": "Region"}}, "autoscaling.cloudwatch.dimension"),
])
def test_config_errors_name_the_key(section: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as e:
        local_config({"autoscaling": section})
    assert path in str(e.value)


async def test_a_balancer_process_publishes_to_cloudwatch_and_shows_the_gauge(
    moto_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`skymesh balancer` with autoscaling.cloudwatch: the data points reach a CloudWatch
    emulator (moto on loopback; boto3 finds it through AWS_ENDPOINT_URL_CLOUDWATCH) in the
    region's AWS region, and /metrics carries the gauge."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_CLOUDWATCH", moto_url)
    port = free_port()
    # a replica nobody listens on: never healthy, nothing queued, the signal is 0
    data = one_region_config({"r0": f"http://127.0.0.1:{free_port()}"}, port, free_port())
    data["regions"][0]["aws_region"] = "eu-central-1"
    data["autoscaling"] = {"cloudwatch": {"namespace": "SkyMesh/Test", "interval_s": 1.0}}
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(data))
    child = Child("balancer", skymesh_cmd("balancer", "--config", str(path), "--region", "us-east-1",
                                          "--no-controller", "--no-peers"), tmp_path)
    cw = boto3.client("cloudwatch", region_name="eu-central-1", endpoint_url=moto_url)
    child.start()
    try:
        await child.wait_ready(HANG_GUARD_S)
        deadline = time.monotonic() + HANG_GUARD_S
        metrics: list[dict[str, Any]] = []
        while not metrics:
            assert time.monotonic() < deadline, f"no data point in CloudWatch\n{child.tail()}"
            await asyncio.sleep(0.1)
            metrics = (await asyncio.to_thread(cw.list_metrics, Namespace="SkyMesh/Test"))["Metrics"]
        assert [(m["MetricName"], m["Dimensions"]) for m in metrics] == [
            ("PendingPrefillSecondsPerReplica", [{"Name": "Region", "Value": "us-east-1"}])]
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            page = await r.text()
        assert 'skymesh_autoscaling_pending_prefill_seconds_per_replica{region="us-east-1"} 0.0' in page
    finally:
        await child.stop()
    # the region's AWS region, not boto3's default
    assert boto3.client("cloudwatch", region_name="us-east-1", endpoint_url=moto_url).list_metrics(
        Namespace="SkyMesh/Test")["Metrics"] == []


def test_in_a_region_of_several_balancers_each_publishes_the_regions_value() -> None:
    from skymesh.routing.push_shares import ShareState
    from skymesh.routing.siblings import RegionSiblings, SiblingMessage

    core = region_core(2)
    core.submit(req(0, 1000), 0.0)
    assert pending_prefill_s_per_replica(core) == pytest.approx(0.5)
    core.attach_siblings(RegionSiblings("here", "here-b0", core.settings.dispatch_budget, dead_after_s=1.0))
    shares = ShareState(balancer_id="here-b1", epoch=1, seq=1, queue_length=3, wants={}, held=frozenset(),
                        claims=frozenset(), grants={}, seen={})
    sibling_pending = 8_000
    msg = SiblingMessage(region="here", shares=shares, sent_at=0.0, pending_prefill_tokens=sibling_pending,
                         placements_per_s=0.0, loads={}, placements=())
    assert core.sibling_state(msg, 0.0)
    # (1000 here + 8000 at the sibling) tokens at 1 ms over 2 healthy replicas
    assert pending_prefill_s_per_replica(core) == pytest.approx(4.5)
