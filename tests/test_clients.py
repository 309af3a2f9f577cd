"""The field's benchmark clients, unmodified, against a one-region mesh with the shipped
tokenizer (docs/clients.md has each recipe): the openai SDK, LiteLLM, ``vllm bench serve``
(from the project's vLLM venv), guidellm, aiperf and inference-perf each run a small
bounded load as a subprocess, offline, and the token counts they report are within 2% of
what was sent (the prompts counted by the tokenizer, BOS included as vLLM counts it) and
generated (max_tokens, the stand-ins' ``usage``), and of what the replicas counted
(``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` before and after).

The clients live in venvs built by ``make clients-env`` (and ``make vllm-env``), never by
a test: without them each test skips with the reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from tokenizers import Tokenizer

from skymesh.assets import SIM_TOKENIZER, SIM_TOKENIZER_DIR
from skymesh.testing import clients_env, vllm_env
from skymesh.testing.tool_venv import ToolVenv
from skymesh.word_tokenizer import GENERATION_PROMPT, chat_prompt
from tests.mesh_helpers import ROOT, local_config_free_ports, report_figures

MODEL = "skymesh-sim"
REQUESTS = 12
PROMPT_TOKENS = 32  # what the synthetic-data clients are asked for
OUTPUT_TOKENS = 16
TOLERANCE = 0.02
CLIENT_TIMEOUT_S = 240.0


# ----------------------------------------------------------------------------- helpers


@dataclass(frozen=True, slots=True)
class Served:
    """What the stand-ins counted (summed over the replicas' Prometheus counters)."""

    prompt: float
    generation: float
    requests: float

    def __sub__(self, other: Served) -> Served:
        return Served(self.prompt - other.prompt, self.generation - other.generation, self.requests - other.requests)


@dataclass(frozen=True, slots=True)
class Mesh:
    url: str  # the balancer, no trailing /v1
    replica_ports: tuple[int, ...]

    def served(self) -> Served:
        totals = {"vllm:prompt_tokens_total": 0.0, "vllm:generation_tokens_total": 0.0,
                  "vllm:request_success_total": 0.0}
        for port in self.replica_ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                for line in r.read().decode().splitlines():
                    name = line.split("{", 1)[0]
                    if name in totals:
                        totals[name] += float(line.rsplit(" ", 1)[1])
        return Served(*totals.values())


def venv_or_skip(tool: ToolVenv) -> ToolVenv:
    reason = tool.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return tool


# the venv fixtures come first in each test's arguments: a missing venv skips the test
# before the mesh is started for it


@pytest.fixture
def clients() -> ToolVenv:
    return venv_or_skip(clients_env.CLIENTS)


@pytest.fixture
def inference_perf() -> ToolVenv:
    return venv_or_skip(clients_env.INFERENCE_PERF)


@pytest.fixture
def vllm_bin() -> Path:
    reason = vllm_env.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return vllm_env.VENV / "bin" / "vllm"


def offline_env(tmp: Path, hf_offline: bool = True) -> dict[str, str]:
    """Nothing leaves loopback: an empty HF cache, the Hub's endpoint on a closed loopback
    port (a stray lookup fails at once instead of waiting on a network), telemetry off."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "TRANSFORMERS_", "VIRTUAL_ENV", "PYTHONPATH", "LITELLM_"))}
    env.update(HF_HOME=str(tmp / "hf-home"), HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_DISABLE_TELEMETRY="1",
               DO_NOT_TRACK="1", LITELLM_LOCAL_MODEL_COST_MAP="True", NO_PROXY="127.0.0.1,localhost",
               no_proxy="127.0.0.1,localhost", PYTHONUNBUFFERED="1")
    if hf_offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def run_client(name: str, cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    """Run a client in its own process group, bounded; whatever it started is killed with
    it, even on failure. Returns its output (asserting it exited 0)."""
    log_path = cwd / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)
    try:
        rc = proc.wait(timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        _kill_group(proc)
    out = log_path.read_text(errors="replace")
    assert rc == 0, f"{name} exited {rc} (None: timed out after {CLIENT_TIMEOUT_S:.0f} s):\n{out[-4000:]}"
    return out


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if sig == signal.SIGTERM:
            time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def close(what: str, got: float, want: float) -> None:
    assert want > 0 and abs(got - want) <= TOLERANCE * want, f"{what}: {got} is not within 2% of {want}"


def sent_tokens(tok: Tokenizer, row: dict[str, Any]) -> int:
    """The prompt tokens of one request as vLLM (and the stand-in) counts them: a text
    prompt with the BOS the tokenizer adds; a chat as the stand-in renders it (it has no
    chat template: docs/replica-sim.md), without special tokens."""
    if "messages" in row:
        text = chat_prompt(row["messages"])
        text = f"{text} {GENERATION_PROMPT}" if text else GENERATION_PROMPT
        return len(tok.encode(text, add_special_tokens=False).ids)
    return len(tok.encode(row["prompt"]).ids)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(SIM_TOKENIZER))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One region (a balancer, two stand-ins, the shipped tokenizer) from ``skymesh up``,
    stopped at the end whatever happened."""
    tmp = tmp_path_factory.mktemp("mesh")
    cfg = local_config_free_ports(time_scale=0.05, tokenizer=True)
    region = cfg["regions"][0]
    region["replicas"] = region["replicas"][:2]
    cfg["regions"] = [region]
    cfg.pop("latencies", None)
    cfg["offload"] = {"enabled": False}
    cfg["controller"]["state_path"] = str(tmp / "ctl.sqlite")
    (tmp / "mesh.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp / "up.log", "w") as log:
        up = subprocess.Popen([sys.executable, "-m", "skymesh.cli", "up", "--config", str(tmp / "mesh.yaml"),
                               "--state-dir", str(tmp / "run")], stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                              env=env, start_new_session=True)
    try:
        url = f"http://{region['balancer']['listen']}"
        body = json.dumps({"model": MODEL, "prompt": "hello mesh", "max_tokens": 2}).encode()
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None, (tmp / "up.log").read_text()[-3000:]
            try:
                req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=10):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, (tmp / "up.log").read_text()[-3000:]
                time.sleep(0.5)
        yield Mesh(url, tuple(r["sim"]["port"] for r in region["replicas"]))
    finally:
        try:
            os.killpg(up.pid, signal.SIGINT)  # skymesh up stops its children
            up.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def check_rows(name: str, rows: list[dict[str, Any]], tok: Tokenizer, served: Served) -> None:
    """An SDK load's rows: no errors, ``usage`` within 2% of the tokenizer's count of what
    was sent, of max_tokens and of the answer re-tokenized, and of the replicas' counts."""
    assert len(rows) == REQUESTS and not [r for r in rows if "error" in r], rows
    sent = sum(sent_tokens(tok, r) for r in rows)
    prompt = sum(r["usage"]["prompt_tokens"] for r in rows)
    completion = sum(r["usage"]["completion_tokens"] for r in rows)
    retokenized = sum(len(tok.encode(r["text"], add_special_tokens=False).ids) for r in rows)
    close(f"{name} usage.prompt_tokens vs the prompts sent", prompt, sent)
    close(f"{name} usage.completion_tokens vs max_tokens", completion, REQUESTS * OUTPUT_TOKENS)
    close(f"{name} the answers re-tokenized vs usage.completion_tokens", retokenized, completion)
    close(f"{name} usage.prompt_tokens vs the replicas' count", prompt, served.prompt)
    close(f"{name} usage.completion_tokens vs the replicas' count", completion, served.generation)
    report_figures(f"clients/{name}", requests=len(rows), errors=0, prompt_tokens=prompt, sent_tokens=sent,
                   completion_tokens=completion, generated=REQUESTS * OUTPUT_TOKENS, served_prompt=served.prompt,
                   served_generation=served.generation)


# ----------------------------------------------------------------------------- the venvs


def test_the_client_venvs_are_found_or_the_reason_given_without_installing(tmp_path: Path) -> None:
    import dataclasses

    for tool in clients_env.VENVS:
        t = dataclasses.replace(tool, venv=tmp_path / tool.venv.name)
        assert "make clients-env" in (t.unavailable_reason() or "")
        assert not t.venv.exists()  # asking never builds
        t.venv.mkdir()
        summary = "the recorded build step failed (exit 1); log: x"
        (t.venv / "build-failed").write_text(f"{summary}\nno index\n")
        reason = t.unavailable_reason() or ""
        assert "could not be built" in reason and summary in reason
        t.bin().parent.mkdir()
        t.bin().write_text("")
        (t.venv / ".installed").write_text("\n".join(p.split("==")[0] + "==0.0.1" for p in t.pins))  # other pins
        assert t.unavailable_reason() is not None
        (t.venv / ".installed").write_text(t.stamp_text)
        assert t.unavailable_reason() is None
    assert clients_env.CLIENTS.pins == clients_env.CLIENT_PINS and all("==" in p for p in clients_env.CLIENT_PINS)


# ----------------------------------------------------------------------------- the clients


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_openai_sdk(clients: ToolVenv, mesh: Mesh, tok: Tokenizer, tmp_path: Path) -> None:
    py = clients.bin("python")
    before = mesh.served()
    out = tmp_path / "openai.jsonl"
    run_client("openai", [py, ROOT / "tests" / "clients" / "openai_load.py", "--base-url", mesh.url + "/v1",
                          "--requests", str(REQUESTS), "--max-tokens", str(OUTPUT_TOKENS), "--out", out],
               offline_env(tmp_path), tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # a streamed answer came one token per delta
    assert all(r["deltas"] == r["usage"]["completion_tokens"] for r in rows if r["stream"])
    check_rows("openai", rows, tok, mesh.served() - before)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_litellm_sdk(clients: ToolVenv, mesh: Mesh, tok: Tokenizer, tmp_path: Path) -> None:
    py = clients.bin("python")
    before = mesh.served()
    out = tmp_path / "litellm.jsonl"
    run_client("litellm", [py, ROOT / "tests" / "clients" / "litellm_load.py", "--api-base", mesh.url + "/v1",
                           "--requests", str(REQUESTS), "--max-tokens", str(OUTPUT_TOKENS), "--out", out],
               offline_env(tmp_path), tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    check_rows("litellm", rows, tok, mesh.served() - before)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_vllm_bench_serve(vllm_bin: Path, mesh: Mesh, tmp_path: Path) -> None:
    """``vllm bench serve`` from the project's vLLM venv, random dataset, both backends
    that speak to an OpenAI server's completions (openai, vllm)."""
    for backend in ("openai", "vllm"):
        before = mesh.served()
        name = f"vllm-bench-{backend}"
        run_client(name, [vllm_bin, "bench", "serve", "--backend", backend, "--base-url", mesh.url, "--model", MODEL,
                          "--tokenizer", SIM_TOKENIZER_DIR, "--dataset-name", "random",
                          "--random-input-len", str(PROMPT_TOKENS), "--random-output-len", str(OUTPUT_TOKENS),
                          "--num-prompts", str(REQUESTS), "--max-concurrency", "4", "--seed", "7",
                          "--save-result", "--result-dir", tmp_path, "--result-filename", f"{name}.json",
                          "--disable-tqdm"],
                   offline_env(tmp_path), tmp_path)
        served = mesh.served() - before
        res = json.loads((tmp_path / f"{name}.json").read_text())
        assert (res["completed"], res["failed"]) == (REQUESTS, 0), res
        # its own count of its prompts (BOS included) against the replicas' and what it asked for
        close(f"{name} total_input_tokens vs the replicas' count", res["total_input_tokens"], served.prompt)
        close(f"{name} total_input_tokens vs requested", res["total_input_tokens"], REQUESTS * PROMPT_TOKENS)
        close(f"{name} total_output_tokens vs max_tokens", res["total_output_tokens"], REQUESTS * OUTPUT_TOKENS)
        close(f"{name} total_output_tokens vs the replicas' count", res["total_output_tokens"], served.generation)
        assert served.requests == REQUESTS
        report_figures(f"clients/{name}", completed=res["completed"], failed=res["failed"],
                       total_input_tokens=res["total_input_tokens"], total_output_tokens=res["total_output_tokens"],
                       served_prompt=served.prompt, served_generation=served.generation)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_guidellm(clients: ToolVenv, mesh: Mesh, tok: Tokenizer, tmp_path: Path) -> None:
    """guidellm's default backend (openai_http: streamed chats) with synthetic text, the
    tokenizer folder as its processor; its per-request token counts against the chats it
    recorded sending, re-counted here, and the replicas' counts."""
    guidellm = clients.bin("guidellm")
    before = mesh.served()
    out = tmp_path / "guidellm.json"
    run_client("guidellm", [guidellm, "run", "--backend", f"kind=openai_http,target={mesh.url},model={MODEL}",
                            "--profile", "kind=concurrent,streams=4",
                            "--constraint", f"kind=max_requests,count={REQUESTS}",
                            "--tokenizer", f"kind=huggingface_auto,model={SIM_TOKENIZER_DIR}",
                            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                            "--output", f"kind=json,path={out}", "--disable-console-interactive"],
               offline_env(tmp_path), tmp_path)
    served = mesh.served() - before
    bench = json.loads(out.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (REQUESTS, 0, 0), totals
    reqs = bench["requests"]["successful"]
    prompt = sum(r["input_metrics"]["text_tokens"] for r in reqs)
    output = sum(r["output_metrics"]["text_tokens"] for r in reqs)
    sent = 0
    for r in reqs:
        body = json.loads(r["request_args"])["body"]
        sent += sent_tokens(tok, {"messages": body["messages"]} if "messages" in body else {"prompt": body["prompt"]})
    close("guidellm input tokens vs the prompts it sent", prompt, sent)
    close("guidellm input tokens vs the replicas' count", prompt, served.prompt)
    close("guidellm output tokens vs output_tokens asked", output, REQUESTS * OUTPUT_TOKENS)
    close("guidellm output tokens vs the replicas' count", output, served.generation)
    report_figures("clients/guidellm", successful=totals["successful"], errored=totals["errored"],
                   input_tokens=prompt, sent_tokens=sent, output_tokens=output, served_prompt=served.prompt,
                   served_generation=served.generation)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_aiperf(clients: ToolVenv, mesh: Mesh, tok: Tokenizer, tmp_path: Path) -> None:
    """aiperf profile on the completions endpoint, streamed, synthetic prompts, the
    tokenizer folder; run without HF_HUB_OFFLINE (its offline mode looks a tokenizer up in
    the HF cache only and refuses a folder: docs/clients.md)."""
    aiperf = clients.bin("aiperf")
    before = mesh.served()
    art = tmp_path / "aiperf"
    run_client("aiperf", [aiperf, "profile", "--model", MODEL, "--url", mesh.url, "--endpoint-type", "completions",
                          "--streaming", "--tokenizer", SIM_TOKENIZER_DIR,
                          "--prompt-input-tokens-mean", str(PROMPT_TOKENS), "--prompt-input-tokens-stddev", "0",
                          "--prompt-output-tokens-mean", str(OUTPUT_TOKENS), "--prompt-output-tokens-stddev", "0",
                          "--request-count", str(REQUESTS), "--concurrency", "4", "--use-server-token-count",
                          "--output-artifact-dir", art, "--ui-type", "none"],
               offline_env(tmp_path, hf_offline=False), tmp_path)
    served = mesh.served() - before
    res = json.loads((art / "profile_export_aiperf.json").read_text())
    assert res["request_count"]["avg"] == REQUESTS and not res.get("error_summary"), res.get("error_summary")
    isl, osl = res["input_sequence_length"]["sum"], res["output_sequence_length"]["sum"]
    prompts = [p["prompt"] for s in json.loads((art / "inputs.json").read_text())["data"] for p in s["payloads"]]
    assert len(prompts) == REQUESTS
    sent = sum(sent_tokens(tok, {"prompt": p}) for p in prompts)
    close("aiperf input sequence length vs the prompts it sent", isl, sent)
    close("aiperf input sequence length vs the replicas' count", isl, served.prompt)
    close("aiperf output sequence length vs max_tokens", osl, REQUESTS * OUTPUT_TOKENS)
    close("aiperf output sequence length vs the replicas' count", osl, served.generation)
    report_figures("clients/aiperf", requests=res["request_count"]["avg"], input_sequence_length_sum=isl,
                   sent_tokens=sent, output_sequence_length_sum=osl, served_prompt=served.prompt,
                   served_generation=served.generation)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inference_perf(inference_perf: ToolVenv, mesh: Mesh, tok: Tokenizer, tmp_path: Path) -> None:
    """inference-perf (its own venv) with docs/clients.md's YAML: random prompts on the
    completions API, streamed, a concurrent stage of REQUESTS requests."""
    exe = inference_perf.bin()
    before = mesh.served()
    out = tmp_path / "report"
    config = {
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": mesh.url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(SIM_TOKENIZER_DIR)},
        "data": {"type": "random",
                 "input_distribution": {"type": "fixed", "mean": PROMPT_TOKENS, "min": PROMPT_TOKENS,
                                        "max": PROMPT_TOKENS},
                 "output_distribution": {"type": "fixed", "mean": OUTPUT_TOKENS, "min": OUTPUT_TOKENS,
                                         "max": OUTPUT_TOKENS}},
        "load": {"type": "concurrent", "num_workers": 1,
                 "stages": [{"num_requests": REQUESTS, "concurrency_level": 4}]},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": True}},
        "storage": {"local_storage": {"path": str(out)}},
    }
    (tmp_path / "config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    run_client("inference-perf", [exe, "-c", tmp_path / "config.yml"], offline_env(tmp_path), tmp_path)
    served = mesh.served() - before
    summary = json.loads((out / "summary_lifecycle_metrics.json").read_text())
    ok, failures = summary["successes"], summary["failures"]
    assert (ok["count"], failures["count"]) == (REQUESTS, 0), failures
    prompt, output = ok["prompt_tokens"]["total"], ok["output_tokens"]["total"]
    per_request = json.loads((out / "per_request_lifecycle_metrics.json").read_text())
    sent = sum(sent_tokens(tok, {"prompt": json.loads(r["request"])["prompt"]}) for r in per_request)
    close("inference-perf prompt tokens vs the prompts it sent", prompt, sent)
    close("inference-perf prompt tokens vs the replicas' count", prompt, served.prompt)
    close("inference-perf output tokens vs max_tokens", output, REQUESTS * OUTPUT_TOKENS)
    close("inference-perf output tokens vs the replicas' count", output, served.generation)
    assert ok["token_count_mismatches"] == 0
    report_figures("clients/inference-perf", successes=ok["count"], failures=failures["count"], prompt_tokens=prompt,
                   sent_tokens=sent, output_tokens=output, served_prompt=served.prompt,
                   served_generation=served.generation)
