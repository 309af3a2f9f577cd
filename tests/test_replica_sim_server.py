"""The stand-in over real HTTP: vLLM's API shapes and metric names, caching, overload,
and the `skymesh replica-sim` command as a real process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skymesh.replica_sim.engine_loop import ENGINE_UNHEALTHY_AFTER_CRASHES
from skymesh.replica_sim.server import ReplicaServer, start_replica
from skymesh.replica_sim.vllm_metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from skymesh.runtime.procs import Child

MODEL = "skymesh-sim"
L = '{engine="0",model_name="skymesh-sim"}'


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Prometheus text format → ({'name{labels}': value}, {family: type})."""
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples, types


async def scrape(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(url + "/metrics") as r:
        assert r.status == 200
        return parse_metrics(await r.text())[0]


async def complete(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


@pytest.fixture
async def replica() -> AsyncIterator[ReplicaServer]:
    srv = await start_replica(profile="tiny-test", time_scale=2.0)
    try:
        yield srv
    finally:
        await srv.close()


async def test_same_long_prompt_twice_hits_the_prefix_cache(replica: ReplicaServer) -> None:
    prompt = " ".join(f"w{i}" for i in range(2000))
    ttft_sum = f"vllm:time_to_first_token_seconds_sum{L}"
    hits = f"vllm:prefix_cache_hits_total{L}"
    async with aiohttp.ClientSession() as s:
        m0 = await scrape(s, replica.url)
        await complete(s, replica.url, prompt, 4)
        m1 = await scrape(s, replica.url)
        await complete(s, replica.url, prompt, 4)
        m2 = await scrape(s, replica.url)
    first, second = m1[ttft_sum] - m0[ttft_sum], m2[ttft_sum] - m1[ttft_sum]
    assert second < 0.5 * first
    assert m1[hits] == m0[hits]  # a cold cache: nothing to hit the first time
    # 2000 tokens = 125 full blocks of 16; the last prompt token is always recomputed, so
    # the 124 blocks before it are the shared full blocks that hit
    assert m2[hits] - m1[hits] == 124 * 16
    assert m2[f"vllm:prefix_cache_queries_total{L}"] - m1[f"vllm:prefix_cache_queries_total{L}"] == 2000


async def test_next_chat_turn_hits_the_previous_answers_blocks(replica: ReplicaServer) -> None:
    # vLLM caches full blocks of generated tokens too: the next turn, whose prompt holds
    # the previous prompt and the answer the stand-in returned, hits on both
    hits = f"vllm:prefix_cache_hits_total{L}"
    first = [{"role": "user", "content": " ".join(f"q{i}" for i in range(40))}]
    async with aiohttp.ClientSession() as s:
        async with s.post(replica.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": first, "max_tokens": 40}) as r:
            answer = (await r.json())["choices"][0]["message"]["content"]
        m0 = await scrape(s, replica.url)
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then"}]
        async with s.post(replica.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": second, "max_tokens": 2}) as r:
            out = await r.json()
        m1 = await scrape(s, replica.url)
    # turn 1: <|user|> + 40 words + <|assistant|> = 42 tokens, then 40 generated; KV
    # exists for 81 of them (the last token is never fed back): 5 full blocks
    assert out["usage"]["prompt_tokens"] == 42 + 40 + 3 + 1
    assert m1[hits] - m0[hits] == 5 * 16


async def test_overload_waits_evicts_and_completes_everything() -> None:
    # 80 blocks: each 300-token request holds 19-21 blocks, so about 3 run at once
    srv = await start_replica(profile="tiny-test", time_scale=2.0, num_gpu_blocks=80)
    try:
        async with aiohttp.ClientSession() as s:
            probe = " ".join(f"probe{k}" for k in range(300))
            await complete(s, srv.url, probe, 2)
            tasks = [
                asyncio.create_task(complete(s, srv.url, " ".join(f"u{i}w{k}" for k in range(300)), 20))
                for i in range(12)
            ]
            saw_waiting = 0.0
            while not all(t.done() for t in tasks):
                m = await scrape(s, srv.url)
                saw_waiting = max(saw_waiting, m[f"vllm:num_requests_waiting{L}"])
                await asyncio.sleep(0.01)
            results = await asyncio.gather(*tasks)
            hits_before = (await scrape(s, srv.url))[f"vllm:prefix_cache_hits_total{L}"]
            await complete(s, srv.url, probe, 2)
            m = await scrape(s, srv.url)
        assert saw_waiting > 0
        assert all(r["usage"]["completion_tokens"] == 20 for r in results)
        assert all(r["choices"][0]["text"].split() == [f"tok{i}" for i in range(20)] for r in results)
        # the probe's cached prefix was evicted by the overload: it no longer hits
        assert srv.engine.evictions > 0
        assert m[f"vllm:prefix_cache_hits_total{L}"] == hits_before
        assert m[f"vllm:kv_cache_usage_perc{L}"] == 0.0
        assert m[f"vllm:num_requests_running{L}"] == 0.0
        assert m[f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}}'] == 14
    finally:
        await srv.close()


async def sse_events(r: aiohttp.ClientResponse) -> list[str]:
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    raw = await r.text()
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


async def test_chat_streaming_format_usage_and_done(replica: ReplicaServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hi there"}],
            "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(replica.url + "/v1/chat/completions", json=body) as r:
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["model"] == MODEL and isinstance(c["created"], int) for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
    content = chunks[1:-1]
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == " tok0 tok1 tok2"
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "length"]
    # <|system|> be brief <|user|> hi there <|assistant|> = 7 tokens under the tokenizer
    # contract: the flattened messages and the generation prompt vLLM's templates append
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "total_tokens": 10, "completion_tokens": 3,
                                   "prompt_tokens_details": None}


async def test_completion_streaming_without_usage(replica: ReplicaServer) -> None:
    body = {"model": MODEL, "prompt": "a b c d", "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(replica.url + "/v1/completions", json=body) as r:
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks] == [" tok0", " tok1", " tok2", " tok3"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_non_streaming_shapes(replica: ReplicaServer) -> None:
    async with aiohttp.ClientSession() as s:
        out = await complete(s, replica.url, "x y z", 5, ignore_eos=True, min_tokens=5)
        async with s.post(replica.url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}) as r:
            chat = await r.json()  # no model given: vLLM serves its only model
        async with s.get(replica.url + "/v1/models") as r:
            models = await r.json()
        async with s.get(replica.url + "/health") as r:
            assert r.status == 200 and await r.read() == b""
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["text"] == " tok0 tok1 tok2 tok3 tok4"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 3, "total_tokens": 8, "completion_tokens": 5,
                            "prompt_tokens_details": None}
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 16
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 4096


@pytest.mark.parametrize(
    ("path", "body", "status", "kind", "param"),
    [
        ("/v1/completions", {"model": MODEL}, 400, "BadRequestError", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "BadRequestError", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "BadRequestError", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "9"}, 400, "BadRequestError", "max_tokens"),
        # vLLM's SamplingParams names no parameter for min_tokens
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400,
         "BadRequestError", None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
         "BadRequestError", "stream_options"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "BadRequestError", "stream"),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x " * 5000, "max_tokens": 100}, 400,
         "BadRequestError", "input_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400,
         "BadRequestError", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, 400, "BadRequestError", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [[1], [-2]]}, 400, "BadRequestError", "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "BadRequestError", "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400,
         "BadRequestError", "messages"),
    ],
)
async def test_errors_are_vllm_shaped(replica: ReplicaServer, path: str, body: dict[str, Any], status: int,
                                      kind: str, param: str | None) -> None:
    async with aiohttp.ClientSession() as s, s.post(replica.url + path, json=body) as r:
        assert r.status == status
        err = await r.json()
    assert set(err) == {"error"}
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert (err["error"]["type"], err["error"]["param"], err["error"]["code"]) == (kind, param, status)
    assert err["error"]["message"]
    assert not replica.engine.has_work()


async def test_unknown_model_404_names_the_served_model(replica: ReplicaServer) -> None:
    async with aiohttp.ClientSession() as s:
        status, out = await post(s, replica.url, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert out["error"]["message"] == "The model `nope` does not exist. Valid aliases: skymesh-sim."


async def test_bad_json_is_a_400(replica: ReplicaServer) -> None:
    async with aiohttp.ClientSession() as s, s.post(replica.url + "/v1/completions", data=b"{oops") as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "BadRequestError"


async def post(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url + path, json=body) as r:
        return r.status, await r.json()


def words(n: int, prefix: str = "w") -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


async def test_prompt_plus_max_tokens_over_the_context_is_clamped_and_served(replica: ReplicaServer) -> None:
    # vLLM 0.32 (entrypoints/serve/utils/api_utils.py get_max_tokens): only the prompt
    # must fit; max_tokens is cut to the context it leaves. tiny-test: max_model_len 4096
    async with aiohttp.ClientSession() as s:
        status, out = await post(s, replica.url, "/v1/completions",
                                 {"model": MODEL, "prompt": words(4000), "max_tokens": 500})
        assert status == 200, out
        assert out["usage"] == {"prompt_tokens": 4000, "completion_tokens": 96, "total_tokens": 4096,
                                "prompt_tokens_details": None}
        assert out["choices"][0]["finish_reason"] == "length"
        # the chat endpoint clamps max_completion_tokens the same way (4093 + 3 = 4096)
        msgs = [{"role": "user", "content": words(4091)}]
        status, out = await post(s, replica.url, "/v1/chat/completions",
                                 {"model": MODEL, "messages": msgs, "max_completion_tokens": 50})
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == 4093 and out["usage"]["completion_tokens"] == 3


async def test_only_a_prompt_longer_than_the_context_is_refused_with_vllms_message(replica: ReplicaServer) -> None:
    head = "This model's maximum context length is 4096 tokens. However, your prompt contains "
    tail = (" input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.")
    async with aiohttp.ClientSession() as s:
        # text is tokenized with truncation at max_model_len + 1: the count stops there
        status, out = await post(s, replica.url, "/v1/completions",
                                 {"model": MODEL, "prompt": words(5000), "max_tokens": 1})
        assert status == 400
        assert out["error"] == {"message": f"{head}at least 4097{tail} (parameter=input_tokens, value=4097)",
                                "type": "BadRequestError", "param": "input_tokens", "code": 400}
        # token ids are counted as given
        status, out = await post(s, replica.url, "/v1/completions",
                                 {"model": MODEL, "prompt": list(range(4100)), "max_tokens": 1})
        assert (status, out["error"]["message"]) == (400, f"{head}4100{tail} (parameter=input_tokens, value=4100)")
        msgs = [{"role": "user", "content": words(4100)}]
        status, out = await post(s, replica.url, "/v1/chat/completions", {"model": MODEL, "messages": msgs})
        assert (status, out["error"]["param"]) == (400, "input_tokens")
        assert out["error"]["message"].startswith(f"{head}at least 4097 input tokens")
        # an output budget longer than the whole context is refused whatever the prompt
        status, out = await post(s, replica.url, "/v1/completions",
                                 {"model": MODEL, "prompt": "a b", "max_tokens": 4097})
        assert (status, out["error"]["param"]) == (400, "max_tokens")
        assert out["error"]["message"] == ("max_tokens=4097 cannot be greater than max_model_len=4096. Please "
                                           "request fewer output tokens. (parameter=max_tokens, value=4097)")
        status, out = await post(s, replica.url, "/v1/chat/completions",
                                 {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                  "max_completion_tokens": 5000})
        assert (status, out["error"]["param"]) == (400, "max_completion_tokens")
        # a prompt that fills the context leaves no token to generate
        status, out = await post(s, replica.url, "/v1/completions",
                                 {"model": MODEL, "prompt": list(range(4096))})
        assert (status, out["error"]["param"]) == (400, "max_tokens")
        assert out["error"]["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    assert not replica.engine.has_work()


async def test_default_max_tokens_is_vllms_per_endpoint(replica: ReplicaServer) -> None:
    async with aiohttp.ClientSession() as s:
        # chat: no default but the context, max_model_len - prompt tokens (4090 here)
        msgs = [{"role": "user", "content": words(4088)}]
        status, out = await post(s, replica.url, "/v1/chat/completions", {"model": MODEL, "messages": msgs})
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == 4090 and out["usage"]["completion_tokens"] == 6
        # completions: 16, also for an explicit null
        for extra in ({}, {"max_tokens": None}):
            status, out = await post(s, replica.url, "/v1/completions", {"model": MODEL, "prompt": "a b", **extra})
            assert (status, out["usage"]["completion_tokens"]) == (200, 16)


async def test_batched_and_token_id_prompts_get_one_choice_each(replica: ReplicaServer) -> None:
    async with aiohttp.ClientSession() as s:
        status, out = await post(s, replica.url, "/v1/completions",
                                 {"model": MODEL, "prompt": ["a b", "c d e"], "max_tokens": 3})
        assert status == 200, out
        assert [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]] == [
            (0, " tok0 tok1 tok2", "length"), (1, " tok0 tok1 tok2", "length")]
        assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                                "prompt_tokens_details": None}
        status, out = await post(s, replica.url, "/v1/completions",
                                 {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
        assert status == 200 and len(out["choices"]) == 1
        assert out["usage"]["prompt_tokens"] == 3
        status, out = await post(s, replica.url, "/v1/completions",
                                 {"model": MODEL, "prompt": [[5, 6], [7, 8, 9], [1]], "max_tokens": 2})
        assert status == 200
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12,
                                "prompt_tokens_details": None}
        # each prompt is clamped to its own context: the long one gets what it leaves
        status, out = await post(s, replica.url, "/v1/completions",
                                 {"model": MODEL, "prompt": ["a", words(4094)], "max_tokens": 5})
        assert status == 200
        assert [c["text"].split()[-1] for c in out["choices"]] == ["tok4", "tok1"]
        # an empty batch is served with no choice, as vLLM does
        status, out = await post(s, replica.url, "/v1/completions", {"model": MODEL, "prompt": []})
        assert (status, out["choices"], out["usage"]["total_tokens"]) == (200, [], 0)
        # streamed: each chunk carries one choice with its prompt's index; usage is summed
        body = {"model": MODEL, "prompt": ["a b", "c"], "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        async with s.post(replica.url + "/v1/completions", json=body) as r:
            events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    by_index: dict[int, list[dict[str, Any]]] = {}
    for c in chunks[:-1]:
        assert len(c["choices"]) == 1
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1]
    for choices in by_index.values():
        assert "".join(c["text"] for c in choices) == " tok0 tok1"
        assert [c["finish_reason"] for c in choices][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 3
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    # token-id prompts share prefixes in the cache like text does
    assert replica.engine.prefix_cache_queries > 0


async def test_metrics_names_types_labels_and_buckets(replica: ReplicaServer) -> None:
    async with aiohttp.ClientSession() as s:
        await complete(s, replica.url, "a b c", 3)
        async with s.get(replica.url + "/metrics") as r:
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            text = await r.text()
    m, types = parse_metrics(text)
    for name, kind in [
        ("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prefix_cache_queries_total", "counter"),
        ("vllm:prefix_cache_hits_total", "counter"), ("vllm:num_preemptions_total", "counter"),
        ("vllm:prompt_tokens_total", "counter"), ("vllm:generation_tokens_total", "counter"),
    ]:
        assert types[name] == kind, name
        assert f"{name}{L}" in m, name
        assert f"# HELP {name} " in text
    assert m[f"vllm:prompt_tokens_total{L}"] == 3 and m[f"vllm:generation_tokens_total{L}"] == 3
    assert m[f"vllm:prefix_cache_queries_total{L}"] == 3
    # prometheus_client sorts label names, so vLLM's scrape puts engine first and the
    # extra label in between
    for reason, value in [("stop", 0), ("length", 1), ("abort", 0)]:
        assert m[f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{MODEL}"}}'] == value
    for name, bounds in [("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                         ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
                         ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)]:
        assert types[name] == "histogram"
        les = [k.split('le="')[1].split('"')[0] for k in m if k.startswith(name + "_bucket")]
        assert les == [repr(float(b)) for b in bounds] + ["+Inf"]
        counts = [m[f'{name}_bucket{{engine="0",le="{le}",model_name="{MODEL}"}}'] for le in les]
        assert counts == sorted(counts)  # cumulative
        assert counts[-1] == m[f"{name}_count{L}"]
        assert f"{name}_sum{L}" in m
        assert types[f"{name}_created"] == "gauge"
    # vLLM v1's bucket lists themselves (vllm/v1/metrics/loggers.py)
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0 and len(ITL_BUCKETS) == 19
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    assert m[f"vllm:time_to_first_token_seconds_count{L}"] == 1
    assert m[f"vllm:inter_token_latency_seconds_count{L}"] == 2  # 3 tokens, 2 gaps
    assert m[f"vllm:e2e_request_latency_seconds_count{L}"] == 1


async def test_cache_config_info_is_exposed_as_vllm_does() -> None:
    # vLLM's info gauge (v1/metrics/loggers.py log_metrics_info): constant 1, CacheConfig's
    # fields as labels plus engine, no model_name
    srv = await start_replica(profile="tiny-test", time_scale=2.0, num_gpu_blocks=80)
    try:
        async with aiohttp.ClientSession() as s, s.get(srv.url + "/metrics") as r:
            text = await r.text()
    finally:
        await srv.close()
    assert "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig" in text
    assert "# TYPE vllm:cache_config_info gauge" in text
    [line] = [ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert line.endswith("} 1.0")
    assert "model_name" not in labels and labels["engine"] == "0"
    assert (labels["num_gpu_blocks"], labels["block_size"], labels["num_gpu_blocks_override"]) == ("80", "16", "80")
    assert labels["enable_prefix_caching"] == "True" and labels["gpu_memory_utilization"] == "0.92"
    # 80 blocks of 16 against a 4096-token context: 0.3125 requests at max_model_len
    assert (labels["kv_cache_size_tokens"], labels["kv_cache_max_concurrency"]) == ("1280", "0.3125")
    assert len(labels) == 37


async def test_client_disconnect_aborts_and_frees_kv(replica: ReplicaServer) -> None:
    body = {"model": MODEL, "prompt": "x " * 500, "max_tokens": 3000, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(replica.url + "/v1/completions", json=body) as r:
            await r.content.readline()
            assert replica.engine.num_running == 1
        for _ in range(200):  # the server notices the closed connection asynchronously
            if not replica.engine.has_work():
                break
            await asyncio.sleep(0.02)
        m = await scrape(s, replica.url)
    assert not replica.engine.has_work()
    assert replica.engine.kv_cache_usage == 0.0
    assert replica.engine.num_free_blocks == replica.engine.num_blocks
    assert m[f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}}'] == 1


async def test_cli_subprocess(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("skymesh")  # the venv's console script
    assert exe.exists(), f"{exe} missing: run make setup"
    child = Child("replica", [str(exe), "replica-sim", "--port", "0", "--profile", "tiny-test",
                              "--time-scale", "0.01"], tmp_path)
    child.start()
    try:
        ports = await child.wait_ready(within_s=60)  # port 0: the ready line says which one
        assert set(ports) == {"http"} and ports["http"] > 0
        url = f"http://127.0.0.1:{ports['http']}"
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                assert r.status == 200
            out = await complete(s, url, "hello world", 5)
        assert out["usage"]["completion_tokens"] == 5
        child.signal_group(signal.SIGTERM)
        assert child.proc is not None
        assert await asyncio.to_thread(child.proc.wait, 20) == 0, child.tail()  # a clean exit on SIGTERM
    finally:
        await child.stop()


# ---------------------------------------------------------------------- engine crashes

RESTARTS = 'skymesh_loop_restarts_total{loop="engine"}'


def crash_engine_steps(replica: ReplicaServer, monkeypatch: pytest.MonkeyPatch, crash_on: set[int]) -> list[int]:
    """Make the engine's step calls numbered in ``crash_on`` (1-based) fail halfway: the
    real step runs, then its running list is emptied behind the requests' backs and the
    step raises. That inconsistency made the old error handler's abort() raise and kill
    the loop. Returns the list of crashed call numbers (appended as they happen)."""
    engine = replica.engine
    real_step = engine.step
    calls = 0
    crashed: list[int] = []

    def step(now: float) -> Any:
        nonlocal calls
        calls += 1
        out = real_step(now)
        if calls in crash_on:
            engine.running.clear()
            crashed.append(calls)
            raise RuntimeError(f"injected engine failure in step {calls}")
        return out

    monkeypatch.setattr(engine, "step", step)
    return crashed


async def health_status(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(url + "/health") as r:
        return r.status


@pytest.mark.timeout(60)
async def test_engine_crash_fails_the_open_request_then_the_engine_restarts(
    replica: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed = crash_engine_steps(replica, monkeypatch, {1})
    body = {"model": MODEL, "prompt": "a b c d", "max_tokens": 4}
    async with aiohttp.ClientSession() as s:
        m0 = await scrape(s, replica.url)
        assert m0[RESTARTS] == 0
        async with s.post(replica.url + "/v1/completions", json=body) as r:
            assert r.status == 500
            err = (await r.json())["error"]
        assert crashed == [1]
        assert err["type"] == "InternalServerError" and err["code"] == 500 and err["message"]
        # the supervisor restarts the loop: the next request is served normally
        out = await complete(s, replica.url, "a b c d", 4)
        assert out["usage"]["completion_tokens"] == 4
        m1 = await scrape(s, replica.url)
        assert await health_status(s, replica.url) == 200
    assert m1[RESTARTS] == 1
    assert replica.engine_loop.supervisor.restarts == 1 and replica.engine_loop.healthy()
    # the crashed request left nothing behind in the engine
    assert not replica.engine.has_work() and replica.engine.kv_cache_usage == 0.0
    assert replica.engine.num_free_blocks == replica.engine.num_blocks


@pytest.mark.timeout(60)
async def test_engine_crash_mid_stream_ends_the_stream_with_an_error(
    replica: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed = crash_engine_steps(replica, monkeypatch, {3})
    body = {"model": MODEL, "prompt": "a b c d", "max_tokens": 50, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(replica.url + "/v1/completions", json=body) as r:
            assert r.status == 200  # the stream had started before the crash
            events = [line for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert crashed == [3]
        assert json.loads(events[-1][len("data: "):])["error"]["code"] == 500
        assert all("choices" in json.loads(e[len("data: "):]) for e in events[:-1])
        assert "data: [DONE]" not in events
        out = await complete(s, replica.url, "a b c d", 3)
        assert out["usage"]["completion_tokens"] == 3
        assert (await scrape(s, replica.url))[RESTARTS] == 1


@pytest.mark.timeout(60)
async def test_health_fails_while_the_engine_keeps_crashing_and_recovers_after_a_step(
    replica: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = ENGINE_UNHEALTHY_AFTER_CRASHES
    crashed = crash_engine_steps(replica, monkeypatch, set(range(1, n + 1)))
    body = {"model": MODEL, "prompt": "a b c d", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        for i in range(1, n + 1):
            assert await health_status(s, replica.url) == 200  # fewer than n crashes in a row
            async with s.post(replica.url + "/v1/completions", json=body) as r:
                assert r.status == 500
            assert crashed == list(range(1, i + 1))
        assert await health_status(s, replica.url) == 503
        # the next step succeeds (only the first n were made to crash): healthy again
        await complete(s, replica.url, "a b c d", 2)
        assert await health_status(s, replica.url) == 200
        assert (await scrape(s, replica.url))[RESTARTS] == n


async def test_health_fails_when_the_engine_loop_is_gone(replica: ReplicaServer) -> None:
    task = replica.engine_loop.task
    assert task is not None
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    async with aiohttp.ClientSession() as s:
        assert await health_status(s, replica.url) == 503


async def test_prompt_tokens_details_report_cached_tokens_as_vllm_does() -> None:
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens is the
    prefix found in the cache at first scheduling, 0 included (vLLM 0.32 writes the field
    whenever the flag is on); shapes as real vLLM writes them (captured from 0.32)."""
    srv = await start_replica(profile="tiny-test", time_scale=2.0, enable_prompt_tokens_details=True)
    prompt = " ".join(f"d{i}" for i in range(100))  # 100 tokens: six full 16-token blocks
    try:
        async with aiohttp.ClientSession() as s:
            first = await complete(s, srv.url, prompt, 2)
            again = await complete(s, srv.url, prompt, 2)
            body = {"model": MODEL, "prompt": prompt + " more", "max_tokens": 2, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                events = await sse_events(r)
            chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
            async with s.post(srv.url + "/v1/chat/completions", json=chat) as r:
                chat_usage = (await r.json())["usage"]
    finally:
        await srv.close()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None,
                                                       "multimodal_tokens": None}
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    # a stream's usage chunk leaves out the fields never set
    assert json.loads(events[-2])["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
    # the chat prompt's tokens differ from the first (role markers): nothing cached, and
    # its full blocks are written
    details = chat_usage["prompt_tokens_details"]
    assert details["cached_tokens"] == 0
    assert details["created_cache_tokens"] == chat_usage["prompt_tokens"] // 16 * 16


async def test_prompt_tokens_details_are_null_without_the_flag(replica: ReplicaServer) -> None:
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        out = await complete(s, replica.url, "a b c", 2)
        async with s.post(replica.url + "/v1/completions", json=body) as r:
            events = await sse_events(r)
    assert out["usage"]["prompt_tokens_details"] is None
    # vLLM leaves the unset field out of a completion's streamed usage chunk
    assert "prompt_tokens_details" not in json.loads(events[-2])["usage"]
