"""Replicas join and leave under load, end to end: a real controller (in process, its gRPC
and HTTP listeners on loopback), a real balancer following it over WatchTopology, and
stand-in replica processes. A replica registered through the API gets requests; once
deregistered it gets no new request, the ones in flight on it finish, and no request
fails; its drain ends when the balancer reports nothing in flight on it."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.service import ControllerService
from skymesh.balancer.server import Balancer
from skymesh.balancer.services import attach_services
from skymesh.config import parse_config
from skymesh.runtime.procs import Child, free_port, start_sim_replicas
from tests.mesh_helpers import one_region_config

pytestmark = pytest.mark.timeout(240)

TOKEN = "registration-token-e2e-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JOINER = "joiner"
WORKERS = 6  # the bounded load: this many requests at a time
# long enough that requests are still streaming on the replica when its drain begins
MAX_TOKENS = 200


async def wait_until(pred: Callable[[], bool], what: str, within_s: float = 60.0) -> None:
    """Polls ``pred``; ``within_s`` is a hang guard only."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


@dataclass
class Result:
    sent: float
    done: float
    status: int
    replica: str | None


@dataclass
class Mesh:
    svc: ControllerService
    balancer: Balancer
    base: str
    controller: str
    joiner_url: str
    joiner: Child


@pytest.fixture
async def mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Mesh]:
    monkeypatch.setenv("SKYMESH_REGISTRATION_TOKEN", TOKEN)
    children, urls = await start_sim_replicas(2, "tiny-test", 1.0, tmp_path, "r")
    svc: ControllerService | None = None
    b: Balancer | None = None
    try:
        port = free_port()
        data = one_region_config({"r0": urls[0]}, port, free_port())
        data["controller"]["state_path"] = str(tmp_path / "controller.sqlite")
        # a long grace: the drain must end by the balancer's report, not by the clock
        data["membership"] = {"drain_grace_s": 600.0, "registration": {"enabled": True}}
        cfg = parse_config(data)
        svc = ControllerService(cfg)
        await svc.start()
        b = Balancer(cfg, "us-east-1")
        attach_services(b, peers=False, controller=True)
        await b.start()
        await wait_until(lambda: b is not None and b.controller_link_port.controller_connected
                         and b.controller_link_port.topology_version > 0
                         and b.core.view.replicas.get("r0") is not None and b.core.view.replicas["r0"].healthy,
                         "the balancer follows the controller and r0 is healthy")
        yield Mesh(svc, b, f"http://127.0.0.1:{b.bound_port}", f"http://127.0.0.1:{svc.bound_ports['http']}",
                   urls[1], children[1])
    finally:
        if b is not None:
            await b.stop()
        if svc is not None:
            await svc.stop()
        await asyncio.gather(*(c.stop() for c in children))


async def replica_requests(s: aiohttp.ClientSession, url: str) -> float:
    """Requests the stand-in itself finished (its vllm:request_success_total)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(x.value for fam in text_string_to_metric_families(text) for x in fam.samples
               if x.name == "vllm:request_success_total")


async def test_a_registered_replica_gets_work_and_drains_without_failures(mesh: Mesh) -> None:
    b = mesh.balancer
    results: list[Result] = []
    stop = asyncio.Event()
    counter = itertools.count()

    async def worker(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            i = next(counter)
            body = {"model": "skymesh-sim", "prompt": f"request {i} " + "word " * 64, "max_tokens": MAX_TOKENS}
            sent = time.monotonic()
            async with s.post(mesh.base + "/v1/completions", json=body) as r:
                await r.read()
                results.append(Result(sent, time.monotonic(), r.status, r.headers.get("X-Skymesh-Replica")))

    async with aiohttp.ClientSession() as s:
        workers = [asyncio.create_task(worker(s)) for _ in range(WORKERS)]
        try:
            await wait_until(lambda: len(results) >= 10, "the load runs on r0")
            version = b.controller_link_port.topology_version
            async with s.post(mesh.controller + "/membership/v1/replicas", headers=AUTH,
                              json={"replica_id": JOINER, "url": mesh.joiner_url, "region": "us-east-1"}) as r:
                assert r.status == 200, await r.text()
            registered = time.monotonic()
            # pushed over WatchTopology (the balancer polls nothing), probed on its next round
            await wait_until(lambda: JOINER in b.replicas and b.controller_link_port.topology_version > version,
                             "the balancer learned of the new replica")
            await wait_until(lambda: b.core.view.replicas[JOINER].healthy, "the new replica probed healthy")
            eligible = time.monotonic() - registered
            await wait_until(lambda: b.core.local.dispatches_per_replica.get(JOINER, 0) > 0,
                             "the balancer sent the new replica a request")
            # reported, not asserted (no wall-clock bounds in tests): docs/reliability.md
            print(f"\njoin: the new replica probed healthy (eligible) {eligible:.3f} s and first sent a request "
                  f"{time.monotonic() - registered:.3f} s after its registration (probe interval "
                  f"{b.cfg.policy.probe_interval_s} s; the policy picks it when it is the better place)")
            await wait_until(lambda: any(x.replica == JOINER for x in results), "the new replica served requests")

            # deregister while requests are in flight on it
            await wait_until(lambda: b.core.view.replicas[JOINER].in_flight >= 1, "requests in flight on the new replica")
            async with s.delete(mesh.controller + f"/membership/v1/replicas/{JOINER}", headers=AUTH) as r:
                assert r.status == 200, await r.text()
            await wait_until(lambda: JOINER in b.core.local.draining, "the balancer marked it draining")
            assert b.admin_status()["replicas"][JOINER]["draining"]
            drain_seen = time.monotonic()
            # its drain ends once the balancer reported nothing in flight on it
            await wait_until(lambda: JOINER not in b.replicas, "the drained replica left the balancer")
            done_at_drop = len(results)
            await wait_until(lambda: len(results) >= done_at_drop + 20, "the load goes on without it")
        finally:
            stop.set()
            await asyncio.gather(*workers)
        served_by_joiner = [x for x in results if x.replica == JOINER]
        assert await replica_requests(s, mesh.joiner_url) == len(served_by_joiner)

    assert [x for x in results if x.status != 200] == []
    assert served_by_joiner
    # nothing sent after the balancer marked it draining reached it
    assert all(x.sent < drain_seen for x in served_by_joiner)
    # and what was in flight on it when it started draining finished there
    assert any(x.done > drain_seen for x in served_by_joiner)
    assert mesh.svc.metrics.registry.get_sample_value("skymesh_membership_drained_total", {"reason": "idle"}) == 1
    assert JOINER not in {x.replica_id for a in mesh.svc.topology().balancers for x in a.replicas}
