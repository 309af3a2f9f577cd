"""What token-true prefix hashing adds per request: the balancer's encode of a prompt
(skymesh/prompt_encoder.py) for prompts of ~1k, 8k and 32k tokens, by a tokenizer and by
the UTF-8 byte fallback, p50/p99 over repeated runs, and the off-loop thread hop the
balancer pays for prompts over ``OFF_LOOP_CHARS``.

The tokenizer is a byte-level BPE trained here (offline) on English prose, Japanese prose
and Python-like code, with a 32,000-token vocabulary; a production tokenizer (e.g. Llama
3's 128k vocabulary) has more merges, so treat the figures as the order of magnitude.

    .venv/bin/python -m benchmarks.encode_cost [--runs 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.assets.bpe import train_byte_bpe  # noqa: E402
from skymesh.balancer.openai_request import parse_body  # noqa: E402
from skymesh.balancer.prompt_count import encode_request  # noqa: E402
from skymesh.prompt_encoder import PromptEncoder  # noqa: E402

WORDS = ("load balancer replica prefix cache region latency token request stream queue policy "
         "offload heartbeat controller failover residency budget").split()
JA = "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。東京の天気は晴れのち曇り。"
CODE = "def route(req, replicas):\n    best = min(replicas, key=lambda r: r.load)\n    return best.id\n"


def corpus_text(rnd: random.Random, chars: int) -> str:
    parts: list[str] = []
    n = 0
    while n < chars:
        kind = rnd.random()
        if kind < 0.5:
            s = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 30))) + ". "
        elif kind < 0.75:
            s = JA[rnd.randrange(len(JA)) :] + JA[: rnd.randrange(len(JA))]
        else:
            s = CODE.replace("best", rnd.choice(WORDS))
        parts.append(s)
        n += len(s)
    return "".join(parts)


def train_tokenizer(path: Path) -> None:
    rnd = random.Random(0)
    train_byte_bpe((corpus_text(rnd, 2000) for _ in range(3000)), 32000).save(str(path))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def thread_hop_ms(runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        await asyncio.to_thread(lambda: None)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tokenizer.json"
        t0 = time.perf_counter()
        train_tokenizer(path)
        print(f"trained a 32k-vocabulary BPE in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        by_tokenizer = PromptEncoder.from_files(64, path)
        by_bytes = PromptEncoder(64)
        rnd = random.Random(1)
        rows = []
        for target in (1000, 8000, 32000):
            text = corpus_text(rnd, target * 6)
            ids = by_tokenizer.tokenizer.encode(text).ids
            while len(ids) > target:  # cut to ~target tokens
                text = text[: int(len(text) * target / len(ids))]
                ids = by_tokenizer.tokenizer.encode(text).ids
            body = json.dumps({"model": "m", "prompt": text}).encode()
            for name, enc in (("tokenizer", by_tokenizer), ("bytes", by_bytes)):
                times = []
                for _ in range(args.runs):
                    t = time.perf_counter()
                    encode_request(enc, parse_body(body, "completions", "m"))
                    times.append((time.perf_counter() - t) * 1000)
                rows.append({"tokens": len(ids), "chars": len(text), "mode": name,
                             "p50_ms": round(statistics.median(times), 3), "p99_ms": round(pct(times, 0.99), 3)})
        hop = asyncio.run(thread_hop_ms(args.runs))
        print(json.dumps({"encode": rows, "thread_hop_ms": {"p50": round(statistics.median(hop), 3),
                                                            "p99": round(pct(hop, 0.99), 3)}}, indent=1))


if __name__ == "__main__":
    main()
