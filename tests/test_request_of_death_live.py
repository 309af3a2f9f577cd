"""No request of death, live: a real balancer in front of stand-in replica processes (the
shipped tokenizer, a 4096-token context learned from their /v1/models) refuses prompts
that cannot fit with the replicas' own 400, forwards none of them, ejects no replica and
keeps serving its ordinary traffic throughout; a request that freezes its replica is
answered after that one replica, not carried to the next."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from skymesh.assets import SIM_TOKENIZER
from skymesh.balancer.server import Balancer
from skymesh.config import parse_config
from skymesh.routing.harm import HARMFUL_REQUEST_CODE
from skymesh.runtime.procs import free_port, start_sim_replicas
from skymesh.runtime.prom_text import parse_samples
from tests.mesh_helpers import one_region_config, report_figures
from tests.test_balancer_faults import FakeReplica

pytestmark = [pytest.mark.timeout(240), pytest.mark.fault]

MAX_LEN = 4096  # the tiny-test profile's context


async def start(urls: dict[str, str], **sections: Any) -> Balancer:
    data = one_region_config(urls, free_port(), free_port(), name="round_robin", probe_interval_s=0.05)
    data.update(sections)
    b = Balancer(parse_config(data), "us-east-1")
    await b.start(port=0)
    return b


async def wait_for(cond: Any, what: str) -> None:
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(what)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[tuple[Balancer, dict[str, str]]]:
    children, urls = await start_sim_replicas(3, "tiny-test", 1.0, tmp_path, "r",
                                              extra=["--tokenizer", str(SIM_TOKENIZER)])
    by_name = {c.name: u for c, u in zip(children, urls, strict=True)}
    b = None
    try:
        b = await start(by_name, tokenizer={"path": str(SIM_TOKENIZER)})
        await wait_for(lambda: all(v.healthy for v in b.core.view.replicas.values()), "replicas never became healthy")
        await wait_for(lambda: b.context_window() is not None, "max_model_len never learned from /v1/models")
        yield b, by_name
    finally:
        if b is not None:
            await b.stop()
        await asyncio.gather(*(c.stop() for c in children))


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/completions",
               ) -> tuple[int, dict[str, str], Any]:
    async with s.post(url + path, json={"model": "skymesh-sim", **body}) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def test_oversized_prompts_are_refused_at_the_edge_and_the_region_keeps_serving(
    mesh: tuple[Balancer, dict[str, str]],
) -> None:
    b, urls = mesh
    assert b.context_window() is not None and b.context_window().max_model_len == MAX_LEN
    base = f"http://127.0.0.1:{b.bound_port}"
    over = {"prompt": "w " * 5000, "max_tokens": 4}
    attacks: list[tuple[str, dict[str, Any], str]] = [
        ("4 MB prompt", {"prompt": "w " * 2_000_000, "max_tokens": 4}, "/v1/completions"),
        ("50,000-message chat", {"messages": [{"role": "user", "content": "hi"}] * 50_000, "max_tokens": 4},
         "/v1/chat/completions"),
        ("10 KB prompt", over, "/v1/completions"),
        ("budget over the context", {"prompt": "hello", "max_tokens": MAX_LEN + 1}, "/v1/completions"),
    ]
    served: list[tuple[int, str]] = []
    stop = asyncio.Event()

    async def trickle(s: aiohttp.ClientSession) -> None:
        i = 0
        while not stop.is_set() or i < 10:
            st, headers, _ = await post(s, base, {"prompt": f"ordinary request {i} " * 20, "max_tokens": 4})
            served.append((st, headers.get("X-Skymesh-Replica", "")))
            i += 1
            await asyncio.sleep(0.02)

    async with aiohttp.ClientSession() as s:
        # what a replica itself answers (vLLM's 400), asked directly
        direct = {name: await post(s, urls["r0"], body, path) for name, body, path in attacks}
        task = asyncio.create_task(trickle(s))
        answers = {name: await post(s, base, body, path) for name, body, path in attacks}
        stop.set()
        await task
        async with s.get(base + "/metrics") as r:
            page = await r.text()
    for name, (status, _, body) in answers.items():
        d_status, _, d_body = direct[name]
        assert status == d_status == 400, name
        assert body["error"]["param"] == d_body["error"]["param"], name
        if name == "50,000-message chat":
            # the replica counts the characters of its rendered chat (with the generation
            # prompt), the balancer those of the messages it flattened: the rest is the same
            assert body["error"]["message"].split(" characters")[1] == d_body["error"]["message"].split(" characters")[1]
        else:
            assert body["error"]["message"] == d_body["error"]["message"], name
    assert served and all(st == 200 and replica in urls for st, replica in served)
    for rid in urls:
        assert b.core.view.health_of(rid)["ejections"] == 0, rid
    dispatched = parse_samples(page, ("skymesh_dispatches_total",))["skymesh_dispatches_total"]
    assert dispatched == len(served)  # not one refused request reached a replica
    refusals = parse_samples(page, ("skymesh_context_refusals_total",))["skymesh_context_refusals_total"]
    assert refusals == len(attacks)
    report_figures("request_of_death_refused", attacks=len(attacks), trickle_served=len(served),
                   dispatched=dispatched, ejections=0)


class FreezingReplica(FakeReplica):
    """A replica that freezes (its /metrics and every completion) on a prompt holding
    POISON, until ``thaw``; it answers everything else at once."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.poisoned = 0

    def thaw(self) -> None:
        self.frozen.clear()
        self._never.set()  # what waits is released; nothing waits from now on

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "POISON" in body["prompt"]:
            self.poisoned += 1
            self.frozen.set()
        if self.frozen.is_set():
            await self._never.wait()
        return await super()._completions(request)


async def test_a_request_that_freezes_its_replica_is_answered_after_one_replica_not_three() -> None:
    fakes = [FreezingReplica(f"f{i}") for i in range(3)]
    b = None
    try:
        for f in fakes:
            await f.start()
        b = await start({f.name: f.url for f in fakes}, health={"unhealthy_threshold": 2, "healthy_threshold": 3},
                        upstream={"first_byte_timeout_s": 3000})
        await wait_for(lambda: all(v.healthy for v in b.core.view.replicas.values()), "replicas never became healthy")
        base = f"http://127.0.0.1:{b.bound_port}"
        async with aiohttp.ClientSession() as s:
            poison = asyncio.create_task(post(s, base, {"prompt": "POISON " + "long " * 2000, "max_tokens": 4}))
            ordinary = [await post(s, base, {"prompt": f"short {i}", "max_tokens": 4}) for i in range(12)]
            status, headers, body = await poison
            frozen = next(f for f in fakes if f.poisoned)
            frozen.thaw()
            await wait_for(lambda: not b.core.view.health_of(frozen.name)["ejected"], "the frozen replica never came back")
            after = [await post(s, base, {"prompt": f"after {i}", "max_tokens": 4}) for i in range(6)]
        assert status == 502 and body["error"]["code"] == HARMFUL_REQUEST_CODE
        assert frozen.name in body["error"]["message"]
        assert sum(f.poisoned for f in fakes) == 1  # never placed on a second replica
        assert [st for st, _, _ in ordinary + after] == [200] * 18
        assert b.core.view.health_of(frozen.name)["ejections"] == 1
        assert b.core.view.active_requests == 0
        report_figures("request_of_death_stall", replicas_poisoned=1, ordinary_served=len(ordinary) + len(after))
    finally:
        if b is not None:
            await b.stop()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(f.stop() for f in fakes))
