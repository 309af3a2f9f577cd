"""The default mesh's tokenizer and what a client counts against the stand-in: the shipped
tokenizer folder loads offline and rebuilds byte for byte; the local configs name it for
the stand-ins and the balancer alike; a stand-in started with it reports ``usage`` equal to
the client's own count of the prompt (BOS included, as vLLM adds it) and of the generated
text, one token per streamed delta; and ``n``, ``logprobs`` / ``top_logprobs`` and ``echo``
in vLLM 0.32's shapes and errors."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tokenizers import Tokenizer

from skymesh.assets import SIM_TOKENIZER, SIM_TOKENIZER_DIR, SIM_TOKENIZER_REF, resolve_file_ref
from skymesh.assets.build_tokenizer import FILES, build, differing_files
from skymesh.config import ConfigError
from skymesh.config.load import load_config, parse_config
from skymesh.replica_sim.main import tokenizer_file
from skymesh.replica_sim.server import ReplicaServer, start_replica
from skymesh.replica_sim.tokenization import StandInTokenizer, _one_id_per_repeat
from skymesh.testing import vllm_env
from tests.mesh_helpers import ROOT

MODEL = "skymesh-sim"
LN2 = 0.6931471805599453
PROMPT = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: 12345 日本語."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(SIM_TOKENIZER))


@pytest.fixture
async def replica() -> AsyncIterator[ReplicaServer]:
    srv = await start_replica(profile="tiny-test", time_scale=0.01, tokenizer=SIM_TOKENIZER)
    try:
        yield srv
    finally:
        await srv.close()


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json={"model": MODEL, **body}) as r:
        if body.get("stream") and r.status == 200:
            raw = await r.text()
            events = [e[len("data: "):] for e in raw.split("\n\n")[:-1]]
            assert events[-1] == "[DONE]"
            return r.status, [json.loads(e) for e in events[:-1]]
        return r.status, await r.json()


def ids(tok: Tokenizer, text: str, special: bool = False) -> list[int]:
    return tok.encode(text, add_special_tokens=special).ids


# ----------------------------------------------------------------------------- the folder


def test_the_shipped_tokenizer_loads_offline_and_round_trips(tok: Tokenizer) -> None:
    assert sorted(p.name for p in SIM_TOKENIZER_DIR.iterdir()) == sorted(FILES)
    assert sum(p.stat().st_size for p in SIM_TOKENIZER_DIR.iterdir()) < 1 << 20
    assert 4096 <= tok.get_vocab_size() <= 8192
    enc = tok.encode(PROMPT)
    assert enc.ids[0] == tok.token_to_id("<s>") == 0  # BOS, as Llama's post-processor adds it
    assert tok.decode(enc.ids, skip_special_tokens=True) == PROMPT
    # English-ish: common words are single tokens, so a client's counts look like a model's
    assert len(ids(tok, " the quick brown fox jumps over the lazy dog")) == 9
    config = json.loads((SIM_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")


def test_a_fresh_build_is_byte_for_byte_the_shipped_folder(tmp_path: Path) -> None:
    build(tmp_path)
    assert differing_files(tmp_path, SIM_TOKENIZER_DIR) == []
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert differing_files(tmp_path, SIM_TOKENIZER_DIR) == ["tokenizer_config.json"]


VLLM_PYTHON = vllm_env.VENV / "bin" / "python"  # $SKYMESH_VLLM_VENV or .vllm-venv


@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no .vllm-venv (make vllm-env) with transformers to load it")
def test_transformers_autotokenizer_loads_the_folder_offline_with_the_same_ids(tok: Tokenizer, tmp_path: Path) -> None:
    code = ("import json, sys\nfrom transformers import AutoTokenizer\n"
            "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "print(json.dumps([t(sys.argv[2]).input_ids, t.bos_token, t.eos_token]))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    done = subprocess.run([str(VLLM_PYTHON), "-c", code, str(SIM_TOKENIZER_DIR), PROMPT], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [tok.encode(PROMPT).ids, "<s>", "</s>"]


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("path", [None, ROOT / "configs" / "local.yaml", ROOT / "configs" / "local-fleet.yaml"])
def test_the_local_meshes_use_it_for_stand_ins_and_balancer_whatever_the_cwd(
        path: Path | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path)
    assert cfg.tokenizer.path is not None and Path(cfg.tokenizer.path).samefile(SIM_TOKENIZER)
    assert {rep.sim.tokenizer for r in cfg.regions for rep in r.replicas if rep.sim} == {cfg.tokenizer.path}
    # chunks of token ids line up with the stand-ins' KV blocks
    assert cfg.policy.chunk_tokens % 16 == 0


def test_pkg_references_resolve_inside_the_package_or_fail_by_name() -> None:
    assert Path(resolve_file_ref(SIM_TOKENIZER_REF)).samefile(SIM_TOKENIZER)
    assert resolve_file_ref("models/tokenizer.json") == "models/tokenizer.json"
    data = {**load_config_data(), "tokenizer": {"path": "pkg:no_such_package/tokenizer.json"}}
    with pytest.raises(ConfigError, match=r"tokenizer\.path: .*no Python package named 'no_such_package'"):
        parse_config(data)
    assert Path(tokenizer_file("pkg:skymesh/assets/tokenizer")).samefile(SIM_TOKENIZER)
    with pytest.raises(ValueError, match="no such file"):
        tokenizer_file("pkg:skymesh/assets/nothing")


def load_config_data() -> dict[str, Any]:
    import yaml

    return yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())


# ----------------------------------------------------------------------------- counts


def test_the_generated_piece_repeats_as_one_id_each(tok: Tokenizer) -> None:
    t = StandInTokenizer(SIM_TOKENIZER)
    assert t.piece == " the"
    for n in (1, 2, 7, 100):
        assert ids(tok, t.generated_text(0, n)) == [int(t.filler_hash_tokens(1)[0])] * n
    # the old filler is several ids a word: why clients counted 4-5 tokens per token
    assert len(ids(tok, " tok0 tok1 tok2")) > 3
    assert _one_id_per_repeat(tok, " tok0") is None  # a piece that is no single id is never chosen


async def test_usage_equals_the_clients_count_of_prompt_and_completion(replica: ReplicaServer, tok: Tokenizer) -> None:
    status, out = await post(replica.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 37})
    assert status == 200
    assert out["usage"]["prompt_tokens"] == len(ids(tok, PROMPT, special=True))
    assert out["usage"]["completion_tokens"] == 37 == len(ids(tok, out["choices"][0]["text"]))

    status, chunks = await post(replica.url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}})
    deltas = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert [len(ids(tok, d)) for d in deltas] == [1] * 9  # one token per delta, as vLLM streams
    assert len(ids(tok, "".join(deltas))) == chunks[-1]["usage"]["completion_tokens"] == 9
    assert chunks[-1]["usage"]["prompt_tokens"] == len(ids(tok, PROMPT, special=True))

    status, chat = await post(replica.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12})
    assert len(ids(tok, chat["choices"][0]["message"]["content"])) == chat["usage"]["completion_tokens"] == 12
    # the stand-in's chat flattening, encoded without BOS (a rendered template carries its own)
    assert chat["usage"]["prompt_tokens"] == len(ids(tok, f"<|user|> {PROMPT} <|assistant|>"))


# ----------------------------------------------------------------------------- n, logprobs, echo


def check_completion_logprobs(lp: dict[str, Any], k: int, start: int = 0) -> None:
    """vLLM's completion logprobs: offsets advance by each token's text; a scored
    position shows the token itself first, max(k, 1) entries in all."""
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    n = len(lp["tokens"])
    assert len(lp["text_offset"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["text_offset"][0] == start
    assert all(lp["text_offset"][i + 1] - lp["text_offset"][i] == len(lp["tokens"][i]) for i in range(n - 1))
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        if logprob is None:
            assert top is None
            continue
        assert logprob == pytest.approx(-LN2)
        assert next(iter(top)) == token and len(top) == max(k, 1)
        assert list(top.values()) == sorted(top.values(), reverse=True)


async def test_completion_n_logprobs_and_echo(replica: ReplicaServer, tok: Tokenizer) -> None:
    status, out = await post(replica.url, "/v1/completions", {
        "prompt": ["hello world", "the quick brown fox"], "max_tokens": 4, "n": 2, "logprobs": 3, "echo": True})
    assert status == 200
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    prompts = ["hello world", "hello world", "the quick brown fox", "the quick brown fox"]
    for choice, prompt in zip(out["choices"], prompts, strict=True):
        assert choice["text"] == prompt + " the" * 4
        lp = choice["logprobs"]
        check_completion_logprobs(lp, 3)
        prompt_ids = ids(tok, prompt, special=True)
        assert len(lp["tokens"]) == len(prompt_ids) + 4
        assert lp["tokens"][0] == "<s>" and lp["token_logprobs"][0] is None  # the first has none
        assert "".join(lp["tokens"][1:]) == choice["text"]
        assert choice["prompt_logprobs"][0] is None
        assert [int(next(iter(d))) for d in choice["prompt_logprobs"][1:]] == prompt_ids[1:]
        assert all(len(d) == 3 and [e["rank"] for e in d.values()] == [1, 2, 3] for d in choice["prompt_logprobs"][1:])
    # the prompts once each, every choice's tokens
    assert out["usage"]["prompt_tokens"] == sum(len(ids(tok, p, special=True)) for p in prompts[::2])
    assert out["usage"]["completion_tokens"] == 4 * 4

    status, plain = await post(replica.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 0})
    assert plain["choices"][0]["text"] == " the the" and plain["choices"][0]["prompt_logprobs"] is None
    check_completion_logprobs(plain["choices"][0]["logprobs"], 0)

    # echo without generation: the prompt alone, one (hidden) token counted, as vLLM does
    status, only = await post(replica.url, "/v1/completions", {"prompt": "hello world", "max_tokens": 0, "echo": True})
    assert status == 200 and only["choices"][0]["text"] == "hello world"
    assert only["usage"]["completion_tokens"] == 1 and only["choices"][0]["logprobs"] is None


async def test_completion_stream_n_logprobs_and_echo(replica: ReplicaServer) -> None:
    status, chunks = await post(replica.url, "/v1/completions", {
        "prompt": "hello world", "max_tokens": 3, "n": 2, "logprobs": 1, "echo": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index[choice["index"]].append(choice)
    for choices in by_index.values():
        assert "".join(c["text"] for c in choices) == "hello world the the the"
        assert choices[0]["text"] == "hello world the"  # the prompt rides with the first token
        assert [c["finish_reason"] for c in choices] == [None, None, "length"]
        offset = 0
        for c in choices:
            check_completion_logprobs(c["logprobs"], 1, start=offset)
            offset += sum(len(t) for t in c["logprobs"]["tokens"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_chat_n_logprobs_top_logprobs_and_echo(replica: ReplicaServer, tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    status, out = await post(replica.url, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 3, "n": 3, "logprobs": True, "top_logprobs": 2})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    for choice in out["choices"]:
        content = choice["logprobs"]["content"]
        assert "".join(e["token"] for e in content) == choice["message"]["content"] == " the the the"
        for e in content:
            assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
            assert e["bytes"] == list(e["token"].encode()) and e["logprob"] == pytest.approx(-LN2)
            assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
            assert e["top_logprobs"][1]["logprob"] < e["top_logprobs"][0]["logprob"]
    assert out["usage"]["completion_tokens"] == 9
    # vLLM leaves an empty tool_calls out; prompt_logprobs are null without echo
    assert set(out["choices"][0]["message"]) == {"role", "content"} and out["prompt_logprobs"] is None

    status, plain = await post(replica.url, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 2, "logprobs": True})  # top_logprobs 0: none listed
    assert [e["top_logprobs"] for e in plain["choices"][0]["logprobs"]["content"]] == [[], []]

    # echo: the last message, when it has the answer's role, is written before the answer
    status, echoed = await post(replica.url, "/v1/chat/completions", {
        "messages": [*messages, {"role": "assistant", "content": "Sure:"}], "max_tokens": 2, "echo": True,
        "add_generation_prompt": False})
    assert echoed["choices"][0]["message"]["content"] == "Sure: the the"
    assert echoed["prompt_logprobs"][0] is None and len(echoed["prompt_logprobs"]) == echoed["usage"]["prompt_tokens"]
    assert echoed["usage"]["completion_tokens"] == 2 == len(ids(tok, " the the"))
    # without the generation prompt the answer continues the last message, in its role
    status, as_user = await post(replica.url, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 1, "echo": True, "add_generation_prompt": False})
    assert (as_user["choices"][0]["message"]["role"], as_user["choices"][0]["message"]["content"]) == ("user", "hi the")


async def test_chat_stream_opens_every_choice_then_streams_logprobs(replica: ReplicaServer) -> None:
    status, chunks = await post(replica.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, "stream": True,
        "logprobs": True, "top_logprobs": 1, "stream_options": {"include_usage": True}})
    assert status == 200
    assert [c["choices"][0] for c in chunks[:2]] == [
        {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for j in (0, 1)]
    for j in (0, 1):
        mine = [c["choices"][0] for c in chunks[2:-1] if c["choices"][0]["index"] == j]
        assert [c["delta"]["content"] for c in mine] == [" the", " the"]
        assert [c["finish_reason"] for c in mine] == [None, "length"]
        assert all(len(c["logprobs"]["content"]) == 1 for c in mine)
    assert chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {"prompt": "x", "n": 0}, None, "n must be at least 1, got 0."),
        ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, None,
         "n must be 1 when using greedy sampling, got 2."),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs",
         "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs",
         "Requested sample logprobs of 8192, which is greater than max allowed: 20 (parameter=logprobs, value=8192)"),
        ("/v1/completions", {"prompt": "x", "logprobs": -2}, "logprobs",
         "`logprobs` must be a positive value or -1. (parameter=logprobs, value=-2)"),
        ("/v1/completions", {"prompt": "x", "logprobs": "2"}, "logprobs",
         "`logprobs` must be an integer. (parameter=logprobs, value=2)"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
         "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 30}, "logprobs",
         "Requested sample logprobs of 30, which is greater than max allowed: 20 (parameter=logprobs, value=30)"),
    ],
)
async def test_out_of_range_values_are_refused_as_vllm_refuses_them(
        replica: ReplicaServer, path: str, body: dict[str, Any], param: str | None, message: str) -> None:
    status, err = await post(replica.url, path, {"max_tokens": 2, **body})
    assert status == 400
    assert err["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    assert not replica.engine.has_work()


# ----------------------------------------------------------------------------- the mesh


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_skymesh_up_from_another_directory_counts_as_the_client_does(tmp_path: Path, tok: Tokenizer) -> None:
    """The local mesh (its pkg: tokenizer), started from a directory outside the clone: a
    completion through a balancer reports the client's own counts of prompt and answer."""
    import sys
    import time
    import urllib.error
    import urllib.request

    import yaml

    from tests.mesh_helpers import local_config_free_ports

    cfg = local_config_free_ports(time_scale=0.1, tokenizer=True)
    cfg["controller"]["state_path"] = str(tmp_path / "ctl.sqlite")
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log_path = tmp_path / "up.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as log:
        up = subprocess.Popen([sys.executable, "-m", "skymesh.cli", "up", "--config", str(path), "--state-dir",
                               str(tmp_path / "run")], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env,
                              start_new_session=True)
    try:
        url = f"http://{cfg['regions'][0]['balancer']['listen']}/v1/completions"
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 21}).encode()
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None, log_path.read_text()[-3000:]
            try:
                req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=10) as r:
                    out = json.loads(r.read())
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.5)
        assert out["usage"]["prompt_tokens"] == len(ids(tok, PROMPT, special=True))
        assert out["usage"]["completion_tokens"] == 21 == len(ids(tok, out["choices"][0]["text"]))
    finally:
        os.killpg(up.pid, 2)  # SIGINT: skymesh up stops its children
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, 9)
            up.wait()
