"""Prefill/decode pairs under faults, on real processes: a balancer in front of two prefill
and two decode stand-ins (vLLM 0.32's NIXL pull protocol, a 10 s lease), each killed with
SIGKILL at a chosen point of a split request, or frozen with SIGSTOP (a stalled replica:
its connections stay open and nothing answers). Nothing accepted is lost, nothing waits
past its leg's deadline, and no prefill replica keeps blocks past its lease (issue 38)."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skymesh.balancer.server import Balancer
from skymesh.config import parse_config
from skymesh.runtime.procs import Child, free_port, start_sim_replicas
from tests.mesh_helpers import one_region_config
from tests.test_replica_sim_server import parse_metrics

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]

# tiny-test at x100: a 300-token prefill takes ~1.2 s, a decode step ~0.2 s
TIME_SCALE = 100.0
LEASE_S = 10.0
PROMPT = " ".join(f"w{i}" for i in range(300))
EXPIRED = 'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="skymesh-sim"}'
KV_USAGE = 'vllm:kv_cache_usage_perc{engine="0",model_name="skymesh-sim"}'
GENERATED = 'vllm:generation_tokens_total{engine="0",model_name="skymesh-sim"}'
RUNNING = 'vllm:num_requests_running{engine="0",model_name="skymesh-sim"}'
EXTERNAL = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="skymesh-sim",source="external_kv_transfer"}'

# legs bounded by their own deadlines only: the generic first-byte bound is far away
LEG_BOUNDS = {"first_byte_timeout_s": 600.0, "stream_idle_timeout_s": 600.0, "leg_deadline_multiple": 1.5,
              "leg_deadline_floor_s": 2.0}


@dataclass
class PdRegion:
    balancer: Balancer
    procs: dict[str, Child]
    urls: dict[str, str]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.balancer.bound_port}"

    def view(self, rid: str) -> Any:
        return self.balancer.core.view.replicas[rid]


async def wait_for(cond: Callable[[], bool], what: str, polls: int = 600) -> None:
    for _ in range(polls):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(what)


async def start_pd_region(tmp_path: Path, decode_gbps: tuple[float, float] = (100.0, 100.0),
                          upstream: dict[str, float] | None = None) -> PdRegion:
    kv = ["--kv-transfer-port", "0", "--kv-lease-s", str(LEASE_S)]
    procs: dict[str, Child] = {}
    urls: dict[str, str] = {}
    try:
        prefill, purls = await start_sim_replicas(2, "tiny-test", TIME_SCALE, tmp_path, "p", extra=kv)
        procs |= {c.name: c for c in prefill}
        urls |= {c.name: u for c, u in zip(prefill, purls, strict=True)}
        for i, gbps in enumerate(decode_gbps):
            (child,), (url,) = await start_sim_replicas(1, "tiny-test", TIME_SCALE, tmp_path, f"d{i}-",
                                                         extra=[*kv, "--kv-bandwidth-gbps", str(gbps)])
            procs[f"d{i}"], urls[f"d{i}"] = child, url
        data = one_region_config(urls, free_port(), free_port(), name="least_load")
        for replica in data["regions"][0]["replicas"]:
            replica["role"] = "prefill" if replica["id"].startswith("p") else "decode"
        data["pairing"] = {"rule": "always", "profile": "tiny-test"}
        if upstream is not None:
            data["upstream"] = upstream
            # a stalled engine whose API server still answers probes (vLLM's engine core is
            # a process of its own): the freeze below stops probes too, so ejection is put
            # far away, leaving the leg's own deadline the only bound that can act
            data["health"] = {"unhealthy_threshold": 100}
        b = Balancer(parse_config(data), "us-east-1")
        await b.start(port=0)
    except BaseException:
        await asyncio.gather(*(p.stop() for p in procs.values()))
        raise
    region = PdRegion(b, procs, urls)
    await wait_for(lambda: all(v.available for v in b.core.view.replicas.values()), "replicas never became ready")
    return region


@pytest.fixture
async def pd_region(tmp_path: Path) -> AsyncIterator[PdRegion]:
    region = await start_pd_region(tmp_path)
    try:
        yield region
    finally:
        await region.balancer.stop()
        await asyncio.gather(*(p.stop() for p in region.procs.values()))


async def metrics(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(url + "/metrics") as r:
        return parse_metrics(await r.text())[0]


async def ask(s: aiohttp.ClientSession, base: str, n: int, *, stream: bool, max_tokens: int = 4) -> tuple[int, str]:
    body = {"model": "skymesh-sim", "prompt": f"{n} {PROMPT}", "max_tokens": max_tokens, "stream": stream}
    async with s.post(base + "/v1/completions", json=body) as r:
        return r.status, await r.text()


def nothing_booked(region: PdRegion) -> bool:
    return all(v.in_flight == 0 and v.pending_prefill_tokens == 0 and v.pending_decodes == 0
               and v.pending_decode_tokens == 0 for v in region.balancer.core.view.replicas.values())


async def no_blocks_held(s: aiohttp.ClientSession, region: PdRegion, names: list[str]) -> None:
    """Every named prefill replica holds no KV: its blocks were read, or its lease ran out."""
    for name in names:
        for _ in range(300):
            if (await metrics(s, region.urls[name]))[KV_USAGE] == 0.0:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"{name} still holds KV blocks")


async def test_a_prefill_replica_killed_mid_prefill_is_replaced_by_the_other(pd_region: PdRegion) -> None:
    region = pd_region
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(ask(s, region.base, 1, stream=False))
        await wait_for(lambda: any(region.view(p).in_flight for p in ("p0", "p1")), "no prefill leg was sent")
        victim = "p0" if region.view("p0").in_flight else "p1"
        other = "p1" if victim == "p0" else "p0"
        await region.procs[victim].kill()
        status, text = await task
        assert status == 200, text
        assert json.loads(text)["usage"]["completion_tokens"] == 4
        # the other prefill replica ran the retried prefill leg, a decode replica read it
        assert (await metrics(s, region.urls[other]))[GENERATED] == 1
        await no_blocks_held(s, region, [other])
    assert nothing_booked(region)


@pytest.mark.parametrize("fault", ["killed", "frozen"])
async def test_a_decode_replica_lost_before_its_first_token_is_replaced_and_the_kv_read_there(
        tmp_path: Path, fault: str) -> None:
    """Killed, or frozen (only the decode leg's own deadline can end the wait then: the
    connection stays open and the generic bounds are far away)."""
    # d0 reads KV slowly (~4 s a prompt): the window in which its leg has no token yet
    region = await start_pd_region(tmp_path, decode_gbps=(0.25, 100.0),
                                   upstream=LEG_BOUNDS if fault == "frozen" else None)
    victim = region.procs["d0"]
    try:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(ask(s, region.base, 2, stream=True))
            # the prefill leg answered and the decode leg went to d0 (the first of equals)
            await wait_for(lambda: region.view("d0").pending_decodes == 1
                           and not any(region.view(p).in_flight for p in ("p0", "p1")), "no decode leg on d0")
            if fault == "killed":
                await victim.kill()
            else:
                victim.signal_group(signal.SIGSTOP)
            status, text = await asyncio.wait_for(task, 120)
            assert status == 200, text
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            # the decode leg alone went to d1, which read the KV the prefill held: one
            # prefill leg in all, and no lease ran out
            after = {p: await metrics(s, region.urls[p]) for p in ("p0", "p1")}
            assert sum(m[GENERATED] for m in after.values()) == 1
            assert sum(m[EXPIRED] for m in after.values()) == 0
            assert (await metrics(s, region.urls["d1"]))[EXTERNAL] > 0
            await no_blocks_held(s, region, ["p0", "p1"])
        assert nothing_booked(region)
    finally:
        if fault == "frozen":
            victim.signal_group(signal.SIGCONT)
        await region.balancer.stop()
        await asyncio.gather(*(p.stop() for p in region.procs.values()))


async def test_a_decode_replica_killed_after_its_first_token_ends_the_stream_with_an_error_event(
        pd_region: PdRegion) -> None:
    region = pd_region
    body = {"model": "skymesh-sim", "prompt": f"3 {PROMPT}", "max_tokens": 200, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(region.base + "/v1/completions", json=body) as r:
            assert r.status == 200
            first = await r.content.readline()
            assert first.startswith(b"data: ")
            # the replica streaming to it is the one whose leg started (its booking ended)
            streaming = [d for d in ("d0", "d1") if (await metrics(s, region.urls[d]))[RUNNING] == 1]
            assert len(streaming) == 1
            victim = streaming[0]
            await region.procs[victim].kill()
            rest = (await r.content.read()).decode()
        assert '"error"' in rest and "data: [DONE]" not in rest
        # the prefill replica's blocks were read before the first token: none held
        await no_blocks_held(s, region, ["p0", "p1"])
    assert nothing_booked(region)



async def test_a_frozen_prefill_replica_is_given_up_at_the_legs_deadline_and_the_other_serves(
        tmp_path: Path) -> None:
    region = await start_pd_region(tmp_path, upstream=LEG_BOUNDS)
    frozen: Child | None = None
    try:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(ask(s, region.base, 4, stream=False))
            await wait_for(lambda: any(region.view(p).in_flight for p in ("p0", "p1")), "no prefill leg was sent")
            victim = "p0" if region.view("p0").in_flight else "p1"
            other = "p1" if victim == "p0" else "p0"
            frozen = region.procs[victim]
            frozen.signal_group(signal.SIGSTOP)
            # only the prefill leg's deadline (1.5 x the 2 s TTFT target) can end the wait:
            # the connection stays open and the generic bound is 600 s
            status, text = await asyncio.wait_for(task, 120)
            assert status == 200, text
            assert json.loads(text)["usage"]["completion_tokens"] == 4
            assert (await metrics(s, region.urls[other]))[GENERATED] == 1
            await no_blocks_held(s, region, [other])
        assert nothing_booked(region)
    finally:
        if frozen is not None:
            frozen.signal_group(signal.SIGCONT)
        await region.balancer.stop()
        await asyncio.gather(*(p.stop() for p in region.procs.values()))

