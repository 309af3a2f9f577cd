"""The stand-in's prefill/decode disaggregation, as vLLM 0.32's NIXL pull connector plays
it (kv_transfer.py): two stand-ins on loopback, a prefill leg that holds its blocks and
answers NIXL's kv_transfer_params, a decode leg that reads them, leases, failure policies,
invalid params, aborts, and a stand-in without a connector."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from skymesh.config.sim import SimReplica
from skymesh.replica_sim import main as sim_main
from skymesh.replica_sim.kv_transfer import KVTransferSettings, default_engine_id
from skymesh.replica_sim.server import ReplicaServer, start_replica
from tests.test_replica_sim_server import parse_metrics

MODEL = "skymesh-sim"
L = '{engine="0",model_name="skymesh-sim"}'
PROMPT = " ".join(f"w{i}" for i in range(300))
FAST = 0.05  # time_scale: the tiny-test engine twenty times faster


def src(source: str) -> str:
    return f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="skymesh-sim",source="{source}"}}'


async def scrape(s: aiohttp.ClientSession, srv: ReplicaServer) -> dict[str, float]:
    async with s.get(srv.url + "/metrics") as r:
        assert r.status == 200
        return parse_metrics(await r.text())[0]


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 60.0) -> None:
    """Poll until ``check`` holds; the bound is only a hang guard (generous on a loaded
    2-core machine), never a latency assertion."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {within_s}s")


def prefill_body(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    """The prefill leg as vLLM's toy proxy sends it."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}, **extra}


async def prefill(s: aiohttp.ClientSession, srv: ReplicaServer, request_id: str = "pd-1",
                  prompt: str = PROMPT) -> dict[str, Any]:
    async with s.post(srv.url + "/v1/completions", json=prefill_body(prompt),
                      headers={"X-Request-Id": request_id}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def decode_stream(s: aiohttp.ClientSession, srv: ReplicaServer, params: dict[str, Any] | None,
                        request_id: str = "pd-1", max_tokens: int = 5) -> tuple[int, list[dict[str, Any]]]:
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if params is not None:
        body["kv_transfer_params"] = params
    async with s.post(srv.url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as r:
        events = []
        async for line in r.content:
            text = line.decode().strip()
            if text.startswith("data: ") and text != "data: [DONE]":
                events.append(json.loads(text[6:]))
        return r.status, events


def settings(**kw: Any) -> KVTransferSettings:
    return KVTransferSettings(**kw)


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Awaitable[ReplicaServer]]]:
    started: list[ReplicaServer] = []

    async def start(kv: KVTransferSettings | None = None, time_scale: float = FAST, **kw: Any) -> ReplicaServer:
        srv = await start_replica(profile="tiny-test", time_scale=time_scale, kv_transfer=kv, **kw)
        started.append(srv)
        return srv

    try:
        yield start
    finally:
        for srv in started:
            await srv.close()


async def test_prefill_leg_holds_its_blocks_until_the_decode_leg_reads_them(servers: Any) -> None:
    p = await servers(settings())
    d = await servers(settings())
    async with aiohttp.ClientSession() as s:
        ans = await prefill(s, p)
        plen = ans["usage"]["prompt_tokens"]
        assert ans["id"] == "cmpl-pd-1"
        kv = ans["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == p.kv.engine_id == default_engine_id("127.0.0.1", p.port)
        assert kv["remote_request_id"].startswith("cmpl-pd-1-") and kv["remote_request_id"] != "pd-1"
        assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", p.kv.port) and p.kv.port != p.port
        assert (kv["tp_size"], kv["dcp_size"], kv["pp_size"]) == (1, 1, 1)
        assert kv["remote_num_tokens"] == plen
        assert kv["remote_blocks_expiry_time"] is None and kv["transfer_mode"] == "pull"
        assert kv["remote_prefill_cached_tokens"] == 0
        blocks = kv["remote_block_ids"]
        assert len(blocks) == 1 and len(blocks[0]) == -(-plen // p.engine.block_size)
        # the blocks stay held after the answer
        assert (await scrape(s, p))[f"vllm:kv_cache_usage_perc{L}"] > 0
        assert p.engine.held and not p.engine.requests

        status, events = await decode_stream(s, d, kv)
        assert status == 200
        text = "".join(c["text"] for e in events for c in e.get("choices", []))
        assert text and all("kv_transfer_params" not in e for e in events)
        assert events[-1]["usage"]["completion_tokens"] == 5 and events[0]["id"] == "cmpl-pd-1"
        # read: P freed them
        assert (await scrape(s, p))[f"vllm:kv_cache_usage_perc{L}"] == 0
        assert not p.engine.held and not p.kv.leases
        m = await scrape(s, d)
        # the last prompt token is recomputed, as vLLM's decode side does
        assert m[src("external_kv_transfer")] == plen - 1
        assert m[src("local_compute")] == 1 and m[src("local_cache_hit")] == 0
        assert m[f"vllm:external_prefix_cache_hits_total{L}"] == plen - 1
        assert m[f"vllm:external_prefix_cache_queries_total{L}"] == plen
        assert m[f"vllm:nixl_xfer_time_seconds_count{L}"] == 1
        assert m[f"vllm:nixl_num_failed_transfers_total{L}"] == 0
        pm = await scrape(s, p)
        assert pm[src("local_compute")] == plen and pm[f"vllm:nixl_num_kv_expired_reqs_total{L}"] == 0


async def test_decode_leg_reports_the_prefill_replicas_cache_hits(servers: Any) -> None:
    p = await servers(settings(), enable_prompt_tokens_details=True)
    d = await servers(settings(), enable_prompt_tokens_details=True)
    async with aiohttp.ClientSession() as s:
        first = await prefill(s, p, "a")
        await decode_stream(s, d, first["kv_transfer_params"], "a")
        kv = (await prefill(s, p, "b"))["kv_transfer_params"]
        assert kv["remote_prefill_cached_tokens"] > 0
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": kv}
        async with s.post(d.url + "/v1/completions", json=body) as r:
            ans = await r.json()
        assert ans["usage"]["prompt_tokens_details"]["cached_tokens"] == kv["remote_prefill_cached_tokens"]
        assert ans["kv_transfer_params"] is None


async def test_heartbeats_keep_a_slow_transfer_alive_past_the_lease(servers: Any) -> None:
    p = await servers(settings(lease_s=0.3))
    # a link so slow that the pull lasts several leases
    d = await servers(settings(lease_s=0.3, bandwidth_gbps=0.0004))
    async with aiohttp.ClientSession() as s:
        kv = (await prefill(s, p))["kv_transfer_params"]
        status, events = await decode_stream(s, d, kv)
        assert status == 200 and "error" not in events[0]
        assert (await scrape(s, p))[f"vllm:nixl_num_kv_expired_reqs_total{L}"] == 0
        assert (await scrape(s, d))[src("external_kv_transfer")] > 0


async def expired_params(s: aiohttp.ClientSession, p: ReplicaServer) -> dict[str, Any]:
    kv: dict[str, Any] = (await prefill(s, p))["kv_transfer_params"]

    async def expired() -> bool:
        return (await scrape(s, p))[f"vllm:nixl_num_kv_expired_reqs_total{L}"] == 1

    await eventually(expired)
    assert (await scrape(s, p))[f"vllm:kv_cache_usage_perc{L}"] == 0
    return kv


async def test_decode_leg_after_the_lease_expired_fails_under_policy_fail(servers: Any) -> None:
    p = await servers(settings(lease_s=0.1))
    d = await servers(settings())
    async with aiohttp.ClientSession() as s:
        kv = await expired_params(s, p)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": kv}
        async with s.post(d.url + "/v1/completions", json=body) as r:
            assert r.status == 500
            assert await r.json() == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                                "param": None, "code": 500}}
        # streamed: vLLM's 200 stream carries the error event
        status, events = await decode_stream(s, d, kv)
        assert status == 200
        assert events == [{"error": {"message": "Internal server error", "type": "InternalServerError",
                                     "param": None, "code": 500}}]
        m = await scrape(s, d)
        assert m[f"vllm:nixl_num_failed_transfers_total{L}"] == 2
        assert m[src("external_kv_transfer")] == 0 and not d.engine.requests


async def test_decode_leg_after_the_lease_expired_recomputes_under_policy_recompute(servers: Any) -> None:
    p = await servers(settings(lease_s=0.1))
    d = await servers(settings(load_failure_policy="recompute"))
    async with aiohttp.ClientSession() as s:
        kv = await expired_params(s, p)
        status, events = await decode_stream(s, d, kv)
        assert status == 200 and events[-1]["usage"]["completion_tokens"] == 5
        m = await scrape(s, d)
        plen = events[-1]["usage"]["prompt_tokens"]
        assert m[f"vllm:nixl_num_failed_transfers_total{L}"] == 1
        assert m[src("external_kv_transfer")] == 0 and m[src("local_compute")] == plen


async def test_engine_id_mismatch_and_unknown_request_fail_the_read(servers: Any) -> None:
    p = await servers(settings())
    d = await servers(settings())
    async with aiohttp.ClientSession() as s:
        kv = (await prefill(s, p))["kv_transfer_params"]
        for bad in ({**kv, "remote_engine_id": "someone-else"}, {**kv, "remote_request_id": "cmpl-nope-0-0"}):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": bad}
            async with s.post(d.url + "/v1/completions", json=body) as r:
                assert r.status == 500
        assert p.engine.held  # still held for the right reader
        status, _ = await decode_stream(s, d, kv)
        assert status == 200 and not p.engine.held


@pytest.fixture
async def dial_counter() -> AsyncIterator[tuple[int, list[str]]]:
    """A loopback HTTP server that records every request it gets."""
    seen: list[str] = []

    async def any_request(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"alive": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_request)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    try:
        yield port, seen
    finally:
        await runner.cleanup()


async def test_missing_fields_and_disallowed_hosts_recompute_without_dialling(
        servers: Any, dial_counter: tuple[int, list[str]]) -> None:
    port, seen = dial_counter
    d = await servers(settings())
    full = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
            "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": port}
    cases = [
        {k: v for k, v in full.items() if k != "remote_block_ids"},  # missing field
        {**full, "remote_host": None},
        {**full, "remote_host": "localhost"},  # a name, not an IP literal: never resolved nor dialled
        {**full, "remote_host": "10.0.0.1"},  # not loopback, not a peer
        {**full, "remote_port": "1234"},
    ]
    async with aiohttp.ClientSession() as s:
        for params in cases:
            status, events = await decode_stream(s, d, params)
            assert status == 200 and events[-1]["usage"]["completion_tokens"] == 5
        m = await scrape(s, d)
    assert seen == []
    assert m[src("external_kv_transfer")] == 0 and m[f"vllm:nixl_num_failed_transfers_total{L}"] == 0


async def test_aborted_prefill_leg_frees_its_blocks_at_once(servers: Any) -> None:
    # slow enough that the client leaves mid-prefill
    p = await servers(settings(), time_scale=50.0)
    long_prompt = " ".join(f"x{i}" for i in range(3000))
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(prefill(s, p, "gone", long_prompt))

        async def running() -> bool:
            return p.engine.num_running == 1

        await eventually(running)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async def freed() -> bool:
            return not p.engine.requests

        await eventually(freed)
        assert not p.engine.held and not p.kv.leases
        m = await scrape(s, p)
        assert m[f"vllm:kv_cache_usage_perc{L}"] == 0
        assert m[f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}}'] == 1


async def test_streamed_prefill_leg_carries_no_params_and_its_lease_expires(servers: Any) -> None:
    p = await servers(settings(lease_s=0.1))
    async with aiohttp.ClientSession() as s:
        body = {**prefill_body(), "stream": True}
        async with s.post(p.url + "/v1/completions", json=body) as r:
            text = await r.text()
        assert r.status == 200 and "kv_transfer_params" not in text

        async def expired() -> bool:
            return (await scrape(s, p))[f"vllm:nixl_num_kv_expired_reqs_total{L}"] == 1

        await eventually(expired)
        assert not p.engine.held


async def test_without_a_connector_params_are_ignored_and_answered_null(servers: Any) -> None:
    plain = await servers(None)
    async with aiohttp.ClientSession() as s:
        ans = await prefill(s, plain)
        assert ans["kv_transfer_params"] is None
        assert not plain.engine.held
        m = await scrape(s, plain)
        assert m[f"vllm:kv_cache_usage_perc{L}"] == 0
        assert not any(k.startswith(("vllm:nixl_", "vllm:prompt_tokens_by_source", "vllm:external_prefix"))
                       for k in m)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "kv_transfer_params": None}
        async with s.post(plain.url + "/v1/chat/completions", json=chat) as r:
            assert (await r.json())["kv_transfer_params"] is None
        # a decode leg's params: recomputed, nothing dialled
        status, events = await decode_stream(s, plain, {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                                                         "remote_port": 1, "remote_block_ids": [[0]],
                                                         "remote_engine_id": "e", "remote_request_id": "r"})
        assert status == 200 and events[-1]["usage"]["completion_tokens"] == 5


async def test_chat_prefill_leg_answers_params(servers: Any) -> None:
    p = await servers(settings())
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1,
            "kv_transfer_params": prefill_body()["kv_transfer_params"]}
    async with aiohttp.ClientSession() as s:
        async with s.post(p.url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "c1"}) as r:
            ans = await r.json()
    assert ans["id"] == "chatcmpl-c1"
    assert ans["kv_transfer_params"]["remote_request_id"].startswith("chatcmpl-c1-")
    assert ans["kv_transfer_params"]["remote_num_tokens"] == ans["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("value", "shown"), [(5, "'5'"), ("x", "'x'"), ([1, 2], "'<list of 2 items>'"),
                                              (True, "'true'")])
async def test_kv_transfer_params_of_the_wrong_type_is_a_400(servers: Any, value: Any, shown: str) -> None:
    srv = await servers(None)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "kv_transfer_params": value}
    async with aiohttp.ClientSession() as s, s.post(srv.url + "/v1/completions", json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "Bad Request" and err["code"] == 400 and err["param"] == "body.kv_transfer_params"
    assert err["message"] == ("1 validation error:\n  {'type': 'dict_type', 'loc': 'body.kv_transfer_params', "
                              f"'msg': 'Input should be a valid dictionary', 'input': {shown}}}")


def test_config_section_becomes_the_stand_ins_flags() -> None:
    rep = SimReplica.model_validate({"profile": "tiny-test", "port": 9000, "kv_transfer": {
        "port": 9100, "lease_s": 12, "load_failure_policy": "recompute", "engine_id": "p0", "peers": ["10.1.2.3"]}})
    assert rep.kv_transfer is not None
    parser = argparse.ArgumentParser()
    sim_main.add_arguments(parser)
    args = parser.parse_args(["--port", "0", *rep.kv_transfer.cli_args()])
    assert (args.kv_transfer_port, args.kv_lease_s, args.kv_load_failure_policy, args.kv_engine_id,
            args.kv_peer, args.kv_bandwidth_gbps, args.kv_latency_ms) == (
        9100, 12.0, "recompute", "p0", ["10.1.2.3"], 100.0, 0.5)
    with pytest.raises(ValueError, match="kv_transfer.port"):
        SimReplica.model_validate({"profile": "tiny-test", "port": 9000, "kv_transfer": {"port": 9000}})


async def test_a_decode_leg_refused_with_a_400_frees_the_prefill_blocks(servers: Any) -> None:
    p = await servers(settings())
    d = await servers(settings())
    async with aiohttp.ClientSession() as s:
        kv = (await prefill(s, p))["kv_transfer_params"]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 0, "kv_transfer_params": kv}
        async with s.post(d.url + "/v1/completions", json=body) as r:
            assert r.status == 400
        assert not p.engine.held and not p.kv.leases
        assert (await scrape(s, p))[f"vllm:kv_cache_usage_perc{L}"] == 0
