"""Token-true prompt identity: the model's tokenizer (trained here, offline), the UTF-8
byte fallback, token-id and batched prompts, the chat template, and Japanese prompts
without spaces sharing a prefix and landing on the same replica."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skymesh.assets.bpe import train_byte_bpe
from skymesh.balancer.openai_request import parse_body
from skymesh.balancer.prompt_count import encode_request
from skymesh.balancer.server import Balancer
from skymesh.balancer.wiring import build_encoder
from skymesh.config import ConfigError, parse_config
from skymesh.prompt_encoder import PromptEncoder, byte_chunk_hashes
from skymesh.runtime.procs import free_port
from tests.mesh_helpers import one_region_config
from tests.test_balancer_faults import FakeReplica

CHUNK = 16

JA_SENTENCES = [
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。",
    "何でも薄暗いじめじめした所でニャーニャー泣いていた事だけは記憶している。",
    "東京の天気は晴れのち曇り、夕方から雨が降るでしょう。",
    "この文書は負荷分散装置の設計について説明します。",
]
EN_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A load balancer keeps the cache warm by sending shared prefixes to the same replica.",
]


def japanese_text(seed: int, chars: int) -> str:
    """Japanese prose without spaces, ``chars`` characters, different per seed."""
    out = []
    k = seed
    while sum(map(len, out)) < chars:
        out.append(JA_SENTENCES[k % len(JA_SENTENCES)] + f"第{k}節。")
        k = (k * 7 + 3) % 1000
    return "".join(out)[:chars]


def prompt_pair(seed: int) -> tuple[str, str]:
    """Two 4,000-character Japanese prompts sharing their first 3,000 characters."""
    shared = japanese_text(seed, 3000)
    return shared + "甲" + japanese_text(seed + 1, 999), shared + "乙" + japanese_text(seed + 2, 999)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer trained here on English and Japanese text, saved
    as tokenizer.json with a chat template beside it (nothing is downloaded)."""
    d = tmp_path_factory.mktemp("tok")
    corpus = [japanese_text(i, 400) for i in range(40)] + EN_SENTENCES * 20
    train_byte_bpe(corpus, 800, special_tokens=["<s>", "</s>"]).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return d


def shared_chunks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_japanese_prompts_share_a_prefix_in_the_byte_fallback() -> None:
    enc = PromptEncoder(CHUNK, bytes_per_token=4)
    a, b = prompt_pair(1)
    ea, eb = enc.encode_text(a), enc.encode_text(b)
    # the shared 3,000 characters (mostly 3 UTF-8 bytes each) in 64-byte chunks
    shared_bytes = len(a[:3000].encode())
    assert shared_bytes > 2 * 3000  # multi-byte text, no spaces
    assert shared_chunks(ea.chunk_hashes, eb.chunk_hashes) == shared_bytes // (CHUNK * 4)
    assert ea.chunk_hashes != eb.chunk_hashes
    assert ea.tokens == -(-len(a.encode()) // 4)
    # a whitespace change is a different prompt, as it is for the replica's tokenizer
    assert enc.encode_text("hello  world").chunk_hashes != enc.encode_text("hello world").chunk_hashes
    # the whole-prefix hash vector: equal prefixes, equal keys
    assert byte_chunk_hashes(b"x" * 64, 64) == byte_chunk_hashes(b"x" * 64 + b"y", 64)[:1]


def test_japanese_prompts_share_a_prefix_by_tokenizer(tokenizer_dir: Path) -> None:
    enc = PromptEncoder.from_files(CHUNK, tokenizer_dir / "tokenizer.json")
    a, b = prompt_pair(2)
    ea, eb = enc.encode_text(a), enc.encode_text(b)
    ids_a = enc.tokenizer.encode(a).ids
    ids_shared = enc.tokenizer.encode(a[:3000]).ids
    assert ea.tokens == len(ids_a) and ea.tokens > 100  # real tokens, not one "word"
    # every full chunk inside the shared 3,000 characters is shared (the last token of
    # the shared part may merge with what follows)
    assert shared_chunks(ea.chunk_hashes, eb.chunk_hashes) >= (len(ids_shared) - 1) // CHUNK
    assert shared_chunks(ea.chunk_hashes, eb.chunk_hashes) < len(ea.chunk_hashes)
    # a token-id prompt of the same ids hashes like the text
    assert enc.encode_ids(ids_a) == ea


def test_token_id_and_batched_prompts_are_accepted(tokenizer_dir: Path) -> None:
    cfg = parse_config({**one_region_config({"r": "http://127.0.0.1:1"}, free_port(), free_port()),
                        "tokenizer": {"path": str(tokenizer_dir / "tokenizer.json")}})
    enc = build_encoder(cfg)

    def parsed(prompt: Any) -> Any:
        return parse_body(json.dumps({"model": "skymesh-sim", "prompt": prompt}).encode(), "completions",
                          "skymesh-sim")

    text = "The quick brown fox jumps over the lazy dog."
    ids = enc.tokenizer.encode(text).ids
    as_text, as_ids = encode_request(enc, parsed(text)), encode_request(enc, parsed(ids))
    assert as_ids.chunk_hashes == as_text.chunk_hashes and as_ids.tokens == len(ids)
    batch = parsed([text, "A load balancer"])
    assert batch.batch_size == 2
    one = encode_request(enc, batch)
    assert one.chunk_hashes == as_text.chunk_hashes  # routed on the first prompt
    assert one.tokens == len(ids) + len(enc.tokenizer.encode("A load balancer").ids)
    ids_batch = encode_request(enc, parsed([ids, [5, 6, 7]]))
    assert ids_batch.tokens == len(ids) + 3
    for bad in ([], [1, "x"], [[1], []], [True], [-1], [1 << 40], [[1], "x"]):
        with pytest.raises(Exception) as e:
            parsed(bad)
        assert getattr(e.value, "status", None) == 400, bad


def test_chat_template_renders_and_refuses(tokenizer_dir: Path) -> None:
    cfg = parse_config({**one_region_config({"r": "http://127.0.0.1:1"}, free_port(), free_port()),
                        "tokenizer": {"path": str(tokenizer_dir / "tokenizer.json"),
                                      "chat_template": str(tokenizer_dir / "chat_template.jinja")}})
    enc = build_encoder(cfg)
    assert enc.chat_template is not None
    assert enc.chat_template.render([{"role": "user", "content": "hi"}]) == "<s><|user|>hi</s><|assistant|>"

    def chat(messages: Any) -> Any:
        return parse_body(json.dumps({"model": "skymesh-sim", "messages": messages}).encode(), "chat", "skymesh-sim")

    system = {"role": "system", "content": japanese_text(5, 600)}
    one = encode_request(enc, chat([system, {"role": "user", "content": "東京の天気は?"}]))
    two = encode_request(enc, chat([system, {"role": "user", "content": "大阪の天気は?"}]))
    # the system prompt is shared: every chunk but the last (which holds the question)
    assert shared_chunks(one.chunk_hashes, two.chunk_hashes) == len(one.chunk_hashes) - 1 >= 2
    with pytest.raises(Exception) as e:
        encode_request(enc, chat([{"role": "tool", "content": "x"}]))
    assert getattr(e.value, "status", None) == 400 and "roles must be" in str(e.value)


def test_a_missing_tokenizer_file_names_its_config_key(tmp_path: Path) -> None:
    cfg = parse_config({**one_region_config({"r": "http://127.0.0.1:1"}, free_port(), free_port()),
                        "tokenizer": {"path": str(tmp_path / "nope.json")}})
    with pytest.raises(ConfigError) as e:
        build_encoder(cfg)
    assert "tokenizer.path" in str(e.value)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError) as e:
        build_encoder(parse_config({**one_region_config({"r": "http://127.0.0.1:1"}, free_port(), free_port()),
                                    "tokenizer": {"path": str(broken)}}))
    assert "tokenizer" in str(e.value)


@pytest.mark.parametrize("with_tokenizer", [False, True])
async def test_japanese_prompts_sharing_3000_characters_go_to_the_same_replica(
    tokenizer_dir: Path, with_tokenizer: bool
) -> None:
    fakes = [FakeReplica(f"r{i}", service_s=0.2) for i in range(4)]
    for f in fakes:
        await f.start()
    data = one_region_config({f.name: f.url for f in fakes}, free_port(), free_port(), name="prefix_tree",
                             probe_interval_s=0.05, chunk_tokens=CHUNK)
    if with_tokenizer:
        data["tokenizer"] = {"path": str(tokenizer_dir / "tokenizer.json")}
    b = Balancer(parse_config(data), "us-east-1")
    await b.start(port=0)
    placed: list[int] = []  # the matched tokens of each placement decision, in order
    choose = b.policy.choose

    def observed_choose(req: Any, replicas: Any, now: float) -> Any:
        d = choose(req, replicas, now)
        if d.replica_id is not None:
            placed.append(d.matched_tokens)
        return d

    b.policy.choose = observed_choose  # type: ignore[method-assign]
    try:
        for _ in range(400):
            if all(v.healthy for v in b.core.view.replicas.values()):
                break
            await asyncio.sleep(0.05)
        pairs = [prompt_pair(10 * i) for i in range(4)]
        url = f"http://127.0.0.1:{b.bound_port}/v1/completions"

        async def send(s: aiohttp.ClientSession, prompt: str) -> str:
            async with s.post(url, json={"model": "skymesh-sim", "prompt": prompt, "max_tokens": 4}) as r:
                assert r.status == 200, await r.text()
                return r.headers["X-Skymesh-Replica"]

        async with aiohttp.ClientSession() as s:
            first = await asyncio.gather(*(send(s, a) for a, _ in pairs))
            n_first = len(placed)
            second = await asyncio.gather(*(send(s, b_) for _, b_ in pairs))
        assert len(set(first)) > 1  # the first prompts were spread over the replicas
        assert second == first  # each follow-up went where its shared prefix is cached
        # and the policy counted the shared part as cached: ~3,000 characters' worth
        assert len(placed) == n_first + len(pairs)
        assert all(m >= 10 * CHUNK for m in placed[n_first:]), placed
    finally:
        await b.stop()
        for f in fakes:
            await f.stop()


def test_a_chat_without_a_limit_is_assumed_to_run_long() -> None:
    """vLLM 0.32 runs a chat without max_tokens to the end of the context: the balancer
    must not assume 16 tokens (its non-streaming deadline would cut a legit answer)."""
    chat = parse_body(json.dumps({"model": "skymesh-sim", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                      "chat", "skymesh-sim")
    assert chat.max_tokens is None
    completion = parse_body(json.dumps({"model": "skymesh-sim", "prompt": "hi"}).encode(), "completions",
                            "skymesh-sim")
    assert completion.max_tokens == 16  # vLLM's default for /v1/completions
    cfg = parse_config(one_region_config({"r": "http://127.0.0.1:1"}, free_port(), free_port()))
    assert cfg.upstream.unbounded_chat_max_tokens == 8192
