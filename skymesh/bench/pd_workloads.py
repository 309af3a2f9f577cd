"""Workloads for the prefill/decode comparison (skymesh/routing/pairing), in the trace
format (512-token blocks of hash ids), each ``n`` Poisson arrivals at ``rate_per_s``:

- :func:`long_context`: questions over long documents (RAG, code, contracts): a prompt of
  one of ``n_documents`` documents (Zipf popularity, 8–24K tokens) plus a question of its
  own, a medium answer. Prefill-heavy: most of the GPU time is prefill.
- :func:`short_chat`: chat turns behind a few shared system prompts: short prompts, longer
  answers. Decode-heavy.
"""

from __future__ import annotations

import random

from skymesh.bench.traces import TraceRequest
from skymesh.word_tokenizer import TRACE_BLOCK_TOKENS

DOC_BASE = 200_000_000
CHAT_BASE = 210_000_000
OWN_BASE = 220_000_000


def long_context(n: int, rate_per_s: float, *, n_documents: int = 1000, doc_blocks: tuple[int, int] = (16, 48),
                 question_blocks: int = 1, output_len: tuple[int, int] = (128, 512), zipf_s: float = 0.8,
                 seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    sizes = [rng.randint(*doc_blocks) for _ in range(n_documents)]
    weights = [1.0 / (i + 1) ** zipf_s for i in range(n_documents)]
    t, own, out = 0.0, OWN_BASE, []
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        d = rng.choices(range(n_documents), weights)[0]
        ids = tuple(DOC_BASE + d * 1000 + b for b in range(sizes[d])) + tuple(range(own, own + question_blocks))
        own += question_blocks
        out.append(TraceRequest(t, len(ids) * TRACE_BLOCK_TOKENS, rng.randint(*output_len), ids, session=i))
    return out


def short_chat(n: int, rate_per_s: float, *, n_system_prompts: int = 8, prompt_blocks: tuple[int, int] = (1, 2),
               output_len: tuple[int, int] = (128, 768), seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, own, out = 0.0, OWN_BASE, []
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        system = (CHAT_BASE + rng.randrange(n_system_prompts),)
        k = rng.randint(*prompt_blocks)
        ids = system + tuple(range(own, own + k))
        own += k
        out.append(TraceRequest(t, len(ids) * TRACE_BLOCK_TOKENS, rng.randint(*output_len), ids, session=i))
    return out
