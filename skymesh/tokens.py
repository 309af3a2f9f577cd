"""The deterministic tokenizer contract shared by the stand-in replica, the balancer and
the benchmark harness.

* A token is a whitespace-separated word: ``count_tokens(text) == len(text.split())``.
* A chat request is flattened to one prompt: for each message ``<|role|>`` followed by
  its content words, in order (so ``<|system|> You are ...`` shares a prefix with every
  request carrying the same system prompt).
* Trace replay: hash id ``h`` of a Mooncake trace (a 512-token block) becomes
  ``block_text(h)``: 512 words that are unique to ``h``; equal ids give equal text, so
  requests whose ``hash_ids`` share a prefix get prompts sharing that text prefix.

Real vLLM uses a BPE tokenizer, so counts differ there; the balancer only needs prefix
*identity*, which any deterministic split preserves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TRACE_BLOCK_TOKENS = 512


def split_tokens(text: str) -> list[str]:
    return text.split()


def count_tokens(text: str) -> int:
    return len(text.split())


def chat_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """Flatten OpenAI chat messages (validated by the caller) into one prompt string."""
    parts: list[str] = []
    for m in messages:
        parts.append(f"<|{m['role']}|>")
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = " ".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        parts.append(str(content))
    return " ".join(p for p in parts if p)


def block_text(hash_id: int, n_tokens: int = TRACE_BLOCK_TOKENS) -> str:
    """``n_tokens`` words unique to ``hash_id`` (deterministic, no randomness)."""
    return " ".join(f"b{hash_id}w{i}" for i in range(n_tokens))


def trace_prompt(hash_ids: Iterable[int], input_length: int) -> str:
    """Prompt of exactly ``input_length`` tokens whose blocks are ``block_text(hash_id)``.

    The last block of a trace request is usually partial: it is cut to length.
    """
    words: list[str] = []
    for h in hash_ids:
        if len(words) >= input_length:
            break
        words.extend(f"b{h}w{i}" for i in range(TRACE_BLOCK_TOKENS))
    if len(words) < input_length:  # trace lengths beyond its blocks: pad deterministically
        words.extend(f"pad{i}" for i in range(input_length - len(words)))
    return " ".join(words[:input_length])


def filler_tokens(n: int, start: int = 0) -> list[str]:
    """Generated text: filler words ("tok0 tok1 ..."), one per output token."""
    return [f"tok{i}" for i in range(start, start + n)]
