"""The daemon under replica faults: a replica that freezes is ejected and its unstarted
requests go elsewhere at once; a replica that never sends a first byte is given up on at
the first-byte deadline; a background loop that raises is restarted and counted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from skymesh.balancer.membership import ReplicaInfo
from skymesh.balancer.proxy import UpstreamTimeouts
from skymesh.balancer.request_flow import HOP_HEADER, ORIGIN_HEADER, TOKEN_HEADER
from skymesh.balancer.server import Balancer
from skymesh.balancer.wiring import upstream_timeouts
from skymesh.config import parse_config
from skymesh.runtime.procs import free_port
from skymesh.runtime.prom_text import parse_samples
from tests.mesh_helpers import one_region_config, report_figures

pytestmark = [pytest.mark.timeout(90), pytest.mark.fault]

IDLE_METRICS = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"


class FakeReplica:
    """A replica speaking just enough of vLLM's API; ``hang_completions`` makes every
    completion wait forever (and, with ``freeze_on_request``, its /metrics too)."""

    def __init__(self, name: str, *, hang_completions: bool = False, freeze_on_request: bool = False,
                 answer_after: asyncio.Event | None = None, service_s: float = 0.0, freeze_after: int = 1) -> None:
        self.name = name
        self.service_s = service_s  # how long each completion takes (the replica's work)
        self.answer_after = answer_after  # completions wait for this event when given
        self.hang_completions = hang_completions
        self.freeze_on_request = freeze_on_request
        self.freeze_after = freeze_after  # freeze_on_request: on this many requests held
        self.frozen = asyncio.Event()
        self.received = 0
        self._never = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.frozen.is_set():
            await self._never.wait()
        return web.Response(text=IDLE_METRICS)

    async def _completions(self, request: web.Request) -> web.Response:
        self.received += 1
        if self.hang_completions:
            if self.freeze_on_request and self.received >= self.freeze_after:
                self.frozen.set()
            await self._never.wait()
        if self.answer_after is not None:
            await self.answer_after.wait()
        if self.service_s:
            await asyncio.sleep(self.service_s)
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": "skymesh-sim",
                                  "choices": [{"index": 0, "text": self.name, "finish_reason": "length"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        self._never.set()
        if self.runner is not None:
            await self.runner.cleanup()


async def start_balancer(replicas: list[FakeReplica], policy: dict[str, Any] | None = None,
                         peer_listener: bool = False, **sections: Any) -> Balancer:
    """``peer_listener``: with a peer listener (plain HTTP on loopback: no tls section)."""
    data = one_region_config({r.name: r.url for r in replicas}, free_port(), free_port(),
                             name="round_robin", probe_interval_s=0.05, **(policy or {}))
    data.update(sections)
    if peer_listener:
        data["regions"][0]["balancer"]["peer_listen"] = f"127.0.0.1:{free_port()}"
    b = Balancer(parse_config(data), "us-east-1")
    await b.start(port=0)
    for _ in range(200):
        if all(v.healthy for v in b.core.view.replicas.values()):
            return b
        await asyncio.sleep(0.05)
    await b.stop()
    raise TimeoutError("fake replicas never became healthy")


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeReplica]]:
    made: list[FakeReplica] = []
    yield made
    await asyncio.gather(*(r.stop() for r in made))


async def post(s: aiohttp.ClientSession, b: Balancer, i: int) -> tuple[int, str]:
    body = {"model": "skymesh-sim", "prompt": f"distinct prompt {i} " * 8, "max_tokens": 4}
    async with s.post(f"http://127.0.0.1:{b.bound_port}/v1/completions", json=body) as r:
        return r.status, r.headers.get("X-Skymesh-Replica", "")


async def test_a_frozen_replica_is_ejected_and_its_unstarted_requests_go_elsewhere(
    fakes: list[FakeReplica],
) -> None:
    # it freezes holding two requests of one size: a replica failing under its load, not
    # under one request (which would be judged against that request: test_request_of_death_live)
    good, frozen = FakeReplica("good"), FakeReplica("frozen", hang_completions=True, freeze_on_request=True,
                                                    freeze_after=2)
    fakes += [good, frozen]
    for r in fakes:
        await r.start()
    # a first-byte deadline far beyond the test's own timeout: only the ejection can
    # bring the requests sent to the frozen replica back
    b = await start_balancer(fakes, upstream={"first_byte_timeout_s": 3000},
                             health={"unhealthy_threshold": 2, "healthy_threshold": 1})
    try:
        async with aiohttp.ClientSession() as s:
            results = await asyncio.gather(*(post(s, b, i) for i in range(4)))
        assert frozen.received >= 2  # round robin sent it some
        assert results == [(200, "good")] * 4
        assert b.core.view.health_of("frozen")["ejected"]
        assert b.core.view.active_requests == 0
        assert all(v.in_flight == 0 and v.pending_prefill_tokens == 0 for v in b.core.view.replicas.values())
        snap = b.core.view.snapshot()
        assert snap["transitions"].get("placed>queued", 0) >= 1  # abandoned, queued again
        report_figures("replica_frozen", requests=len(results), served=sum(st == 200 for st, _ in results),
                       sent_to_frozen=frozen.received, requeued=snap["transitions"]["placed>queued"],
                       first_byte_timeout_s=3000)
    finally:
        await b.stop()


async def test_no_first_byte_in_time_is_retried_on_another_replica(fakes: list[FakeReplica]) -> None:
    good, silent = FakeReplica("good"), FakeReplica("silent", hang_completions=True)
    fakes += [good, silent]
    for r in fakes:
        await r.start()
    b = await start_balancer(fakes, upstream={"first_byte_timeout_s": 0.3},
                             health={"unhealthy_threshold": 50, "healthy_threshold": 1})
    try:
        async with aiohttp.ClientSession() as s:
            results = await asyncio.gather(*(post(s, b, i) for i in range(4)))
            assert silent.received >= 1
            assert results == [(200, "good")] * 4
            async with s.get(f"http://127.0.0.1:{b.bound_port}/metrics") as r:
                page = await r.text()
        # the only target kind here is a replica: the family's sum is its count
        assert parse_samples(page, ("skymesh_retries_total",))["skymesh_retries_total"] >= 1
        assert b.core.transitions[("placed", "queued")] >= 1
        assert not b.core.view.health_of("silent")["ejected"]  # slow answers are not sickness here
    finally:
        await b.stop()


async def test_a_probe_loop_that_raises_is_restarted_and_counted(
    fakes: list[FakeReplica], monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes.append(FakeReplica("good"))
    await fakes[0].start()
    b = await start_balancer(fakes)
    try:
        real = b._apply_probe
        raised = asyncio.Event()

        def flaky(info: Any, res: Any) -> None:
            if not raised.is_set():
                raised.set()
                raise RuntimeError("injected probe failure")
            real(info, res)

        monkeypatch.setattr(b, "_apply_probe", flaky)
        await asyncio.wait_for(raised.wait(), 30)
        for _ in range(200):
            if b.loop_restart_counts().get("probe") == 1:
                break
            await asyncio.sleep(0.05)
        assert b.loop_restart_counts() == {"probe": 1}
        async with aiohttp.ClientSession() as s:
            assert await post(s, b, 1) == (200, "good")
            async with s.get(f"http://127.0.0.1:{b.bound_port}/metrics") as r:
                page = await r.text()
        assert 'skymesh_loop_restarts_total{loop="probe"} 1.0' in page.splitlines()
    finally:
        await b.stop()


def test_non_streaming_deadline_grows_with_max_tokens_and_streaming_does_not() -> None:
    t = UpstreamTimeouts(first_byte_s=60.0, per_output_token_s=0.05)
    assert t.first_byte_deadline_s(stream=True, max_tokens=8000) == 60.0
    # a 4,000-token non-streaming answer may take 260 s: no fixed 120 s read timeout
    assert t.first_byte_deadline_s(stream=False, max_tokens=4000) == pytest.approx(260.0)
    assert t.first_byte_deadline_s(stream=True, max_tokens=1, extra_s=30.0) == 90.0


def test_per_token_bound_comes_from_the_profile_or_the_config() -> None:
    data = one_region_config({"r0": "http://127.0.0.1:1"}, free_port(), free_port())
    cfg = parse_config(data)
    assert upstream_timeouts(cfg, cfg.regions[0].replicas).per_output_token_s == 0.2  # no profile
    data["upstream"] = {"per_output_token_s": 0.03}
    cfg = parse_config(data)
    assert upstream_timeouts(cfg, cfg.regions[0].replicas).per_output_token_s == 0.03


async def test_residency_holds_on_replicas_adopted_on_failover(fakes: list[FakeReplica]) -> None:
    eu, us = FakeReplica("eu0"), FakeReplica("us0")
    fakes += [eu, us]
    for r in fakes:
        await r.start()
    data = one_region_config({"eu0": eu.url}, free_port(), free_port(), name="round_robin", probe_interval_s=0.05)
    data["regions"][0].update(name="eu-west-1")
    data["regions"][0]["balancer"]["peer_listen"] = f"127.0.0.1:{free_port()}"  # forwards arrive there
    data["regions"].append({
        "name": "us-east-1", "source_networks": ["127.2.0.0/16"],
        "balancer": {"listen": f"127.0.0.1:{free_port()}", "grpc_listen": f"127.0.0.1:{free_port()}"},
        "replicas": [{"id": "us0", "url": us.url}],
    })
    data["latencies"] = [{"regions": ["eu-west-1", "us-east-1"], "one_way_ms": 40}]
    data["offload"] = {"enabled": False, "rules": [{"from": "eu-*", "to": ["eu-*"]}]}
    b = Balancer(parse_config(data), "eu-west-1")
    await b.start(port=0)
    try:
        # the controller hands us-east-1's replica to eu-west-1 (its balancer died)
        b.set_replicas([ReplicaInfo("eu0", eu.url, "eu-west-1"), ReplicaInfo("us0", us.url, "us-east-1")])
        for _ in range(200):
            if all(v.healthy for v in b.core.view.replicas.values()):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            # this balancer's own (EU) clients: round robin would use us0 for half of them
            results = await asyncio.gather(*(post(s, b, i) for i in range(6)))
            assert results == [(200, "eu0")] * 6 and us.received == 0
            # a forwarded request must name a known origin region
            body = {"model": "skymesh-sim", "prompt": "x", "max_tokens": 1}
            async with s.post(f"http://127.0.0.1:{b.peer_port}/v1/completions", json=body,
                              headers={HOP_HEADER: "1", TOKEN_HEADER: b.peer_token,
                                       ORIGIN_HEADER: "mars-1"}) as r:
                assert r.status == 400
            # a request forwarded on behalf of us-east-1's clients may run on us0
            async with s.post(f"http://127.0.0.1:{b.peer_port}/v1/completions", json=body,
                              headers={HOP_HEADER: "1", TOKEN_HEADER: b.peer_token,
                                       ORIGIN_HEADER: "us-east-1"}) as r:
                assert r.status == 200
    finally:
        await b.stop()


async def test_sigterm_drain_finishes_accepted_requests_and_refuses_new_ones(fakes: list[FakeReplica]) -> None:
    release = asyncio.Event()
    fakes.append(FakeReplica("slow", answer_after=release))
    await fakes[0].start()
    b = await start_balancer(fakes)
    port = b.bound_port
    async with aiohttp.ClientSession() as s:
        accepted = [asyncio.create_task(post(s, b, i)) for i in range(3)]
        for _ in range(200):
            if b.core.view.active_requests == 3:
                break
            await asyncio.sleep(0.02)
        assert b.core.view.active_requests == 3
        stopping = asyncio.create_task(b.stop(drain_timeout_s=60))
        for _ in range(200):  # the listening socket closes first
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                await asyncio.sleep(0.02)
            except OSError:
                break
        else:
            pytest.fail("the balancer kept accepting connections while draining")
        assert not stopping.done()  # still draining: its accepted requests are not done
        release.set()
        assert await asyncio.gather(*accepted) == [(200, "slow")] * 3
        await asyncio.wait_for(stopping, 30)
    assert b.core.view.active_requests == 0


async def test_a_draining_balancer_fails_its_health_check_while_it_still_serves_new_connections(
        fakes: list[FakeReplica]) -> None:
    """With drain_listen_s, SIGTERM first turns /health to 503 (the entry in front takes the
    balancer out) while new connections are still served, each told to close."""
    fakes.append(FakeReplica("a"))
    await fakes[0].start()
    b = await start_balancer(fakes)
    url = f"http://127.0.0.1:{b.bound_port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.get(url + "/health") as r:
                assert r.status == 200
            # a listen window longer than the test: it ends when the test stops the balancer
            stopping = asyncio.create_task(b.stop(drain_timeout_s=60, drain_listen_s=3600))
            for _ in range(200):
                async with s.get(url + "/health") as r:
                    health = (r.status, await r.text())
                if health[0] == 503:
                    break
                await asyncio.sleep(0.02)
            assert health == (503, "draining")
            status, replica = await post(s, b, 1)  # a new connection, still accepted and served
            assert (status, replica) == (200, "a")
            body = {"model": "skymesh-sim", "prompt": "during the drain", "max_tokens": 4}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers.get("Connection", "").lower() == "close"
            assert not stopping.done()
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopping
    finally:
        await b.stop()


async def test_a_burst_of_ten_times_capacity_gets_only_fast_429s_with_retry_after(
    fakes: list[FakeReplica],
) -> None:
    """2 replicas x dispatch budget 2 in flight + a queue of 40 = 44 requests of capacity;
    440 arrive at once. Every answer is a 200 or a 429/503 carrying Retry-After (no 5xx,
    no long wait ending in 504), and the balancer serves normally right after."""
    fakes += [FakeReplica("a", service_s=0.05), FakeReplica("b", service_s=0.05)]
    for r in fakes:
        await r.start()
    b = await start_balancer(fakes, policy={"queue_bound": 40}, upstream={"max_queue_wait_s": 10})
    loop = asyncio.get_running_loop()
    base = f"http://127.0.0.1:{b.bound_port}/v1/completions"

    async def one(s: aiohttp.ClientSession, i: int) -> tuple[int, str | None, float]:
        t0 = loop.time()
        body = {"model": "skymesh-sim", "prompt": f"burst {i} " * 8, "max_tokens": 4}
        async with s.post(base, json=body) as r:
            await r.read()
            return r.status, r.headers.get("Retry-After"), loop.time() - t0

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            results = await asyncio.gather(*(one(s, i) for i in range(440)))
            burst_end = loop.time()
            status, _, _ = await one(s, 10_000)
            recovered_after = loop.time() - burst_end
        statuses = sorted({st for st, _, _ in results})
        refused = [(st, ra, dt) for st, ra, dt in results if st != 200]
        print(f"\nburst 440 at once: {sum(st == 200 for st, _, _ in results)} served, "
              f"{sum(st == 429 for st, _, _ in results)} got 429, {sum(st == 503 for st, _, _ in results)} got 503; "
              f"median time to a refusal {sorted(dt for _, _, dt in refused)[len(refused) // 2] * 1000:.1f} ms; "
              f"next request served {recovered_after * 1000:.1f} ms after the burst")
        assert set(statuses) <= {200, 429, 503}, statuses
        assert refused, "a burst of 10x capacity must be refused in part"
        assert all(ra is not None and int(ra) >= 1 for _, ra, _ in refused)
        assert status == 200  # served normally right after
        assert b.core.view.active_requests == 0 and b.core.view.queue_length == 0
    finally:
        await b.stop()


async def test_forged_peer_forwards_and_admin_calls_are_all_refused(fakes: list[FakeReplica]) -> None:
    """Calls that would steer the balancer or read its state without the mesh's secrets:
    a forwarded request (which skips client keys and carries another region's residency)
    without the peer token or with a wrong one (on the peer listener; on the client port
    any forward is refused 403), and /admin/status without the admin token, with a wrong
    one or with the peer token. Every one refused; no replica sees a request."""
    replica = FakeReplica("r0")
    fakes.append(replica)
    await replica.start()
    b = await start_balancer(fakes, peer_listener=True)
    url = f"http://127.0.0.1:{b.bound_port}"
    peer_url = f"http://127.0.0.1:{b.peer_port}"
    body = {"model": "skymesh-sim", "prompt": "forged", "max_tokens": 1}
    forged_forwards = [
        {HOP_HEADER: "1", ORIGIN_HEADER: "us-east-1"},
        {HOP_HEADER: "1", TOKEN_HEADER: "", ORIGIN_HEADER: "us-east-1"},
        {HOP_HEADER: "1", TOKEN_HEADER: "x" * len(b.peer_token), ORIGIN_HEADER: "us-east-1"},
        {HOP_HEADER: "1", TOKEN_HEADER: b.peer_token[:-1], ORIGIN_HEADER: "us-east-1"},
        {HOP_HEADER: "1", TOKEN_HEADER: b.peer_token + "x", ORIGIN_HEADER: "us-east-1"},
    ]
    forged_admin = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {b.peer_token}"},
                    {"Authorization": "Basic " + "x" * 20}]
    statuses: list[int] = []
    on_client_port: list[int] = []
    try:
        async with aiohttp.ClientSession() as s:
            for headers in forged_forwards * 20:
                async with s.post(peer_url + "/v1/completions", json=body, headers=headers) as r:
                    statuses.append(r.status)
                    # the one peer-token check's answer (admin_auth.peer_token_denied)
                    assert (await r.json())["error"]["code"] == "invalid_peer_token"
                async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                    on_client_port.append(r.status)
                    assert (await r.json())["error"]["message"]
            for headers in forged_admin * 20:
                async with s.get(url + "/admin/status", headers=headers) as r:
                    statuses.append(r.status)
        assert set(statuses) == {401}, sorted(set(statuses))
        assert set(on_client_port) == {403}, sorted(set(on_client_port))
        assert replica.received == 0
        forged = len(statuses) + len(on_client_port)
        report_figures("forged_peer_forwards_and_admin_calls", forged=forged,
                       refused=sum(st in (401, 403) for st in statuses + on_client_port),
                       reached_a_replica=replica.received)
    finally:
        await b.stop()
