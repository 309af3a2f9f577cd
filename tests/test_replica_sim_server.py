"""The stand-in over real HTTP: vLLM's API shapes and metric names, caching, overload."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from skymesh.replica_sim.server import ReplicaServer, start_replica
from tests.mesh_helpers import free_port, start_replica_sim, wait_http_ok

MODEL = "skymesh-sim"
LABELS = '{engine="0",model_name="skymesh-sim"}'


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


@pytest.fixture
async def replica() -> AsyncIterator[ReplicaServer]:
    srv = await start_replica(profile="tiny-test", time_scale=2.0)
    try:
        yield srv
    finally:
        await srv.close()


async def stream_ttft(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 4) -> float:
    t0 = time.perf_counter()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                return time.perf_counter() - t0
    raise AssertionError("no token")


async def metrics(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(url + "/metrics") as r:
        return parse_metrics(await r.text())


async def test_same_long_prompt_twice_hits_the_prefix_cache(replica: ReplicaServer) -> None:
    prompt = " ".join(f"w{i}" for i in range(2000))
    async with aiohttp.ClientSession() as s:
        first = await stream_ttft(s, replica.url, prompt)
        before = (await metrics(s, replica.url))[f"vllm:prefix_cache_hits_total{LABELS}"]
        second = await stream_ttft(s, replica.url, prompt)
        after = (await metrics(s, replica.url))[f"vllm:prefix_cache_hits_total{LABELS}"]
    assert second < 0.5 * first
    # 2000 tokens = 125 full blocks of 16; the last token is recomputed → 124 blocks hit
    assert after - before == 124 * 16


async def test_overload_waits_evicts_and_completes_everything() -> None:
    srv = await start_replica(profile="tiny-test", time_scale=2.0, num_gpu_blocks=80)
    try:
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> dict:
                body = {"model": MODEL, "prompt": " ".join(f"u{i}w{k}" for k in range(300)), "max_tokens": 20}
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    return await r.json()

            tasks = [asyncio.create_task(one(i)) for i in range(12)]
            saw_waiting = 0.0
            while not all(t.done() for t in tasks):
                m = await metrics(s, srv.url)
                saw_waiting = max(saw_waiting, m[f"vllm:num_requests_waiting{LABELS}"])
                await asyncio.sleep(0.01)
            results = await asyncio.gather(*tasks)
        assert saw_waiting > 0
        assert all(r["usage"]["completion_tokens"] == 20 for r in results)
        assert all(len(r["choices"][0]["text"].split()) == 20 for r in results)
        assert srv.engine.evictions > 0
        assert srv.engine.kv_cache_usage == 0.0
    finally:
        await srv.close()


async def test_streaming_format_usage_and_done(replica: ReplicaServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hi there"}],
            "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(replica.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.text()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text.split() == ["tok0", "tok1", "tok2"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # <|system|> be brief <|user|> hi there = 6 tokens under the tokenizer contract
    assert chunks[-1]["usage"] == {"prompt_tokens": 6, "total_tokens": 9, "completion_tokens": 3,
                                   "prompt_tokens_details": None}


async def test_errors_are_vllm_shaped(replica: ReplicaServer) -> None:
    async with aiohttp.ClientSession() as s:
        for body, status, param in [
            ({"model": MODEL}, 400, "prompt"),
            ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
            ({"model": "nope", "prompt": "x"}, 404, "model"),
            ({"model": MODEL, "prompt": "x " * 5000}, 400, None),
        ]:
            async with s.post(replica.url + "/v1/completions", json=body) as r:
                assert r.status == status
                err = (await r.json())["error"]
                assert err["code"] == status and err["param"] == param and err["message"]
        async with s.post(replica.url + "/v1/completions", data=b"{oops") as r:
            assert r.status == 400


async def test_metrics_names_types_and_labels(replica: ReplicaServer) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(replica.url + "/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 2}) as r:
            assert r.status == 200
        async with s.get(replica.url + "/metrics") as r:
            text = await r.text()
        async with s.get(replica.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == MODEL
    m = parse_metrics(text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert f"{name}{LABELS}" in m, name
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert m['vllm:time_to_first_token_seconds_count{engine="0",model_name="skymesh-sim"}'] == 1
    assert m['vllm:e2e_request_latency_seconds_bucket{engine="0",model_name="skymesh-sim",le="+Inf"}'] == 1
    assert m['vllm:request_success_total{engine="0",model_name="skymesh-sim",finished_reason="length"}'] == 1
    assert m[f"vllm:prefix_cache_queries_total{LABELS}"] == 3


async def test_client_disconnect_aborts_and_frees_kv(replica: ReplicaServer) -> None:
    body = {"model": MODEL, "prompt": "x " * 500, "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(replica.url + "/v1/completions", json=body) as r:
            await r.content.readline()
        for _ in range(100):
            if not replica.engine.has_work():
                break
            await asyncio.sleep(0.02)
    assert not replica.engine.has_work()
    assert replica.engine.kv_cache_usage == 0.0


async def test_cli_subprocess(tmp_path: Path) -> None:
    port = free_port()
    proc = start_replica_sim(tmp_path, port, "tiny-test", 0.01)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_http_ok(url + "/health", 60, proc)
        async with aiohttp.ClientSession() as s, s.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5}
        ) as r:
            assert (await r.json())["usage"]["completion_tokens"] == 5
    finally:
        proc.stop()
