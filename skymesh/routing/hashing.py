"""Prompt chunk hashing: computed once per request, reused by every routing structure.

``chunk_hashes[i]`` is a cumulative xxhash64: the hash of chunk i seeded with the hash of
chunk i-1, so it identifies the whole prefix made of chunks 0..i (FEATHER's chunked hash
vector). Two prompts share ``chunk_hashes[:k]`` exactly when their first k chunks are equal.

Full chunks only, plus the final partial chunk: the partial chunk makes identical short
prompts (shorter than one chunk) still share a key, and it never matches a longer prompt's
full chunk because its bytes differ (a chunk's word count is part of what is hashed).
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from skymesh.tokens import split_tokens

_SEP = b"\x1f"


def chunk_hashes(tokens: Sequence[str], chunk_tokens: int) -> tuple[int, ...]:
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    out: list[int] = []
    prev = 0
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start : start + chunk_tokens]
        prev = xxhash.xxh64_intdigest(_SEP.join(w.encode() for w in chunk), seed=prev)
        out.append(prev)
    return tuple(out)


def prompt_chunk_hashes(text: str, chunk_tokens: int) -> tuple[int, ...]:
    return chunk_hashes(split_tokens(text), chunk_tokens)


def key_hash(chunks: Sequence[int], length: int) -> int:
    """The ring key of a prompt's first ``length`` chunks (cumulative: just that hash)."""
    if not chunks:
        return 0
    return chunks[min(length, len(chunks)) - 1]
