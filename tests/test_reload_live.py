"""Config reload on SIGHUP, against the real daemons (`skymesh balancer`, `skymesh
controller`) on loopback.

The balancer serves a steady load while the file is rewritten (a client key added, one
removed) and reloaded: requests in flight and queued at that moment are held at the
replicas until the reload is done, and every request of the load must succeed. Then an
invalid file and a file moving the listen port are refused and the old config keeps
serving. The controller, sent a file with one more replica, pushes a topology with it.
Every wait polls for a condition; the limits are only hang guards.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web

from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from skymesh.runtime.procs import Child, free_port, skymesh_cmd
from tests.mesh_helpers import admin_auth, local_config_free_ports, one_region_config

pytestmark = [pytest.mark.timeout(120), pytest.mark.fault]

HANG_GUARD_S = 60.0
ALICE, BOB, CAROL = "sk-reload-alice", "sk-reload-bob", "sk-reload-carol"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def wait_until(pred: Callable[[], bool | Awaitable[bool]], what: str, child: Child | None = None) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        got = pred()
        if await got if inspect.isawaitable(got) else got:
            return
        if child is not None and not child.running():
            raise AssertionError(f"{child.name} exited while waiting for: {what}\n{child.tail()}")
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {HANG_GUARD_S}s: {what}" + (f"\n{child.tail()}" if child else ""))


def counter(page: str, name: str, result: str) -> float:
    prefix = f'{name}{{result="{result}"}} '
    for line in page.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"no {prefix.strip()} on the page")


class HoldingReplica:
    """A replica speaking just enough of vLLM's API. While ``release`` is clear it holds
    every completion and its /metrics reports them as waiting, so the balancer stops
    pushing to it and queues the rest at itself (selective pushing)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()
        self.holding = 0
        self.served = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_running 0.0\nvllm:num_requests_waiting {self.holding}.0\n")

    async def _completions(self, request: web.Request) -> web.Response:
        self.holding += 1
        try:
            await self.release.wait()
            await asyncio.sleep(0.005)
        finally:
            self.holding -= 1
        self.served += 1
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": "skymesh-sim",
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def replicas() -> AsyncIterator[list[HoldingReplica]]:
    made = [HoldingReplica(), HoldingReplica()]
    for r in made:
        await r.start()
    yield made
    await asyncio.gather(*(r.stop() for r in made))


def write(path: Path, data: dict[str, Any]) -> str:
    raw = yaml.safe_dump(data).encode()
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(raw)
    tmp.replace(path)  # as an editor saves: the daemon never reads half a file
    return hashlib.sha256(raw).hexdigest()


class Load:
    """``workers`` clients sending one request after another with ``key`` until stopped
    (at most ``cap`` each): the steady load a reload must not drop anything of."""

    def __init__(self, url: str, key: str, workers: int = 10, cap: int = 2000,
                 release: Sequence[HoldingReplica] = ()) -> None:
        self.url, self.key, self.workers, self.cap = url, key, workers, cap
        # replicas to let go of what they hold on the way out: a check failing while they
        # hold requests must fail as itself, not hang in the workers' wait
        self.release = release
        self.statuses: list[int] = []
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _worker(self, s: aiohttp.ClientSession, w: int) -> None:
        for i in range(self.cap):
            if self.stop.is_set():
                return
            body = {"model": "skymesh-sim", "prompt": f"worker {w} request {i} " * 4, "max_tokens": 4}
            try:
                async with s.post(self.url, json=body, headers={"Authorization": f"Bearer {self.key}"}) as r:
                    await r.read()
                    self.statuses.append(r.status)
            except aiohttp.ClientError:
                self.statuses.append(-1)  # a dropped connection is a failure too

    async def __aenter__(self) -> Load:
        self._session = aiohttp.ClientSession()
        self._tasks = [asyncio.create_task(self._worker(self._session, w)) for w in range(self.workers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        for r in self.release:
            r.release.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()


async def test_a_reload_swaps_client_keys_under_load_and_refuses_bad_files(
    replicas: list[HoldingReplica], tmp_path: Path
) -> None:
    port = free_port()
    data = one_region_config({f"r{i}": r.url for i, r in enumerate(replicas)}, port, free_port(),
                             name="round_robin", probe_interval_s=0.05)
    keys = [{"name": "alice", "sha256": sha(ALICE)}, {"name": "bob", "sha256": sha(BOB)}]
    data["client_auth"] = {"keys": keys, "keys_env": None}
    path = tmp_path / "mesh.yaml"
    first_digest = write(path, data)
    child = Child("balancer", skymesh_cmd("balancer", "--config", str(path), "--region", "us-east-1",
                                          "--no-controller", "--no-peers"), tmp_path)
    base = f"http://127.0.0.1:{port}"
    child.start()
    try:
        await child.wait_ready(HANG_GUARD_S)
        assert child.port("http") == port
        async with aiohttp.ClientSession() as s:

            async def get(path_: str) -> tuple[int, str]:
                async with s.get(base + path_, headers=admin_auth()) as r:
                    return r.status, await r.text()

            async def status() -> dict[str, Any]:
                code, text = await get("/admin/status")
                assert code == 200, text
                return json.loads(text)

            async def reloads(result: str) -> float:
                return counter((await get("/metrics"))[1], "skymesh_config_reloads_total", result)

            async def ask(key: str) -> int:
                body = {"model": "skymesh-sim", "prompt": "who am I", "max_tokens": 4}
                async with s.post(base + "/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    await r.read()
                    return r.status

            async def all_healthy() -> bool:
                reps = (await status())["replicas"]
                return len(reps) == 2 and all(v.get("healthy") for v in reps.values())

            await wait_until(all_healthy, "both replicas probed healthy", child)
            assert (await status())["config"]["sha256"] == first_digest
            assert [await ask(k) for k in (ALICE, BOB, CAROL)] == [200, 200, 401]
            assert (await reloads("ok"), await reloads("error")) == (0.0, 0.0)

            # --- a valid reload under a steady load, with requests in flight and queued
            async with Load(base + "/v1/completions", ALICE, release=replicas) as load:
                await wait_until(lambda: len(load.statuses) >= 20, "the load is flowing", child)
                for r in replicas:
                    r.release.clear()  # from now on the replicas hold what they get

                async def held_and_queued() -> bool:
                    # every request in flight is held at a replica (none still finishing
                    # from before the replicas began to hold: those may end meanwhile)
                    st = await status()
                    return (st["in_flight"] >= 2 and st["queue_length"] >= 1
                            and st["in_flight"] == sum(r.holding for r in replicas))

                await wait_until(held_and_queued, "requests in flight and queued at the balancer", child)
                in_flight_at_reload = (await status())["active_requests"]
                ended_before_reload = len(load.statuses)
                data2 = copy.deepcopy(data)
                data2["client_auth"]["keys"] = [keys[0], {"name": "carol", "sha256": sha(CAROL)}]  # bob out
                second_digest = write(path, data2)
                os.kill(child.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]

                async def reloaded_ok() -> bool:
                    return await reloads("ok") == 1.0

                await wait_until(reloaded_ok, "skymesh_config_reloads_total{result=ok} 1", child)
                # nothing held or queued was dropped by the reload: each is still there or
                # ended (a request may end meanwhile: every status is checked 200 below)
                st_after = await status()
                ended = len(load.statuses) - ended_before_reload
                assert st_after["active_requests"] + ended >= in_flight_at_reload, (
                    in_flight_at_reload, ended, {k: st_after[k] for k in ("active_requests", "in_flight", "queue_length")})
                for r in replicas:
                    r.release.set()
                assert await ask(CAROL) == 200 and await ask(BOB) == 401
                after = len(load.statuses)
                await wait_until(lambda: len(load.statuses) >= after + 40,
                                 "the load goes on after the reload", child)
            assert load.statuses and set(load.statuses) == {200}, (
                f"{sum(s_ != 200 for s_ in load.statuses)} of {len(load.statuses)} requests failed: "
                f"{sorted(set(load.statuses))}")
            st = await status()
            assert st["config"]["sha256"] == second_digest and st["config"]["last_reload"]["result"] == "ok"

            async def drained() -> bool:
                return (await status())["active_requests"] == 0

            await wait_until(drained, "every request of the load ended", child)

            # --- an invalid file: refused, counted, the running config keeps serving
            path.write_text(yaml.safe_dump(data2) + "policy: {queue_bound: -1}\n")
            os.kill(child.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]

            async def one_error() -> bool:
                return await reloads("error") == 1.0

            await wait_until(one_error, "skymesh_config_reloads_total{result=error} 1", child)
            assert [await ask(k) for k in (ALICE, CAROL, BOB)] == [200, 200, 401]
            st = await status()
            assert st["config"]["sha256"] == second_digest and st["config"]["last_reload"]["result"] == "error"
            assert "policy" in st["config"]["last_reload"]["error"]

            # --- a file moving the listen port: refused whole, the field named in the log
            data3 = copy.deepcopy(data2)
            data3["regions"][0]["balancer"]["listen"] = f"127.0.0.1:{free_port()}"
            data3["client_auth"]["keys"] = keys  # bob back: must not be applied either
            write(path, data3)
            os.kill(child.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]

            async def two_errors() -> bool:
                return await reloads("error") == 2.0

            await wait_until(two_errors, "skymesh_config_reloads_total{result=error} 2", child)
            assert [await ask(k) for k in (ALICE, CAROL, BOB)] == [200, 200, 401]
            assert (await reloads("ok")) == 1.0
            refused = [json.loads(line) for line in child.log_path.read_text().splitlines()
                       if line.startswith("{") and "config reload refused" in line]
            assert len(refused) == 1
            assert refused[0]["level"] == "error"
            assert refused[0]["needs_restart"] == "regions[us-east-1].balancer.advertise,regions[us-east-1].balancer.listen"
        assert child.running()
    finally:
        await child.stop()


async def test_the_controller_reloads_membership_and_pushes_it(tmp_path: Path) -> None:
    data = local_config_free_ports()
    data["emulate_latency"] = False
    # no balancer answers here: liveness must not change the topology during the test
    data["controller"].update(state_path=str(tmp_path / "ctl.sqlite"), probe_interval_s=1.0, failure_threshold=100)
    path = tmp_path / "mesh.yaml"
    write(path, data)
    ctl = Child("controller", skymesh_cmd("controller", "--config", str(path), "--grpc-port", "0",
                                          "--http-port", "0"), tmp_path)
    ctl.start()
    seen: list[Any] = []
    watcher: asyncio.Task[None] | None = None
    try:
        await ctl.wait_ready(HANG_GUARD_S)
        http = f"http://127.0.0.1:{ctl.port('http')}"

        async def watch() -> None:  # no TLS in this config: a loopback watcher needs no identity
            async with grpc.aio.insecure_channel(f"127.0.0.1:{ctl.port('grpc')}") as ch:
                stub = mesh_pb2_grpc.ControllerStub(ch)
                async for topo in stub.WatchTopology(mesh_pb2.WatchRequest(region="test", balancer_id="w")):
                    seen.append(topo)

        watcher = asyncio.create_task(watch())
        async with aiohttp.ClientSession(headers=admin_auth()) as s:

            async def get(path_: str) -> str:
                async with s.get(http + path_) as r:
                    assert r.status == 200
                    return await r.text()

            def replicas_of(topo: Any, region: str) -> set[str]:
                return {x.replica_id for b in topo.balancers if b.region == region for x in b.replicas}

            await wait_until(lambda: bool(seen), "a first topology", ctl)
            version = seen[-1].version
            assert replicas_of(seen[-1], "eu-west-1") == {"euw1-r0", "euw1-r1", "euw1-r2"}

            grown = copy.deepcopy(data)
            grown["regions"][1]["replicas"].append({"id": "euw1-r3", "url": "http://127.0.0.1:8214"})
            digest = write(path, grown)
            os.kill(ctl.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]

            async def pushed() -> bool:
                return bool(seen) and "euw1-r3" in replicas_of(seen[-1], "eu-west-1")

            await wait_until(pushed, "a pushed topology with euw1-r3 in eu-west-1", ctl)
            assert seen[-1].version > version
            status = json.loads(await get("/v1/status"))
            assert status["controller"]["config"]["sha256"] == digest
            assert status["controller"]["config"]["last_reload"]["result"] == "ok"
            page = await get("/metrics")
            assert counter(page, "skymesh_controller_config_reloads_total", "ok") == 1.0
            topo = json.loads(await get("/v1/topology"))
            assert "euw1-r3" in {x["replica_id"] for b in topo["balancers"] for x in b["replicas"]}

            # a file changing what needs a restart: refused whole (the new replica not dropped)
            renamed = copy.deepcopy(grown)
            renamed["dns"]["name"] = "llm.elsewhere.local"
            renamed["regions"][1]["replicas"] = renamed["regions"][1]["replicas"][:1]
            write(path, renamed)
            os.kill(ctl.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]

            async def refused() -> bool:
                return counter(await get("/metrics"), "skymesh_controller_config_reloads_total", "error") == 1.0

            await wait_until(refused, "skymesh_controller_config_reloads_total{result=error} 1", ctl)
            topo = json.loads(await get("/v1/topology"))
            assert {x["replica_id"] for b in topo["balancers"] for x in b["replicas"]} >= {"euw1-r1", "euw1-r3"}
            assert "dns.name" in ctl.log_path.read_text()
        assert ctl.running()
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await ctl.stop()
