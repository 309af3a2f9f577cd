"""Prompt chunk hashing: computed once per request, reused by every routing structure.

``chunk_hashes[i]`` is a cumulative xxhash64: the hash of chunk i seeded with the hash of
chunk i-1, so it identifies the whole prefix made of chunks 0..i (FEATHER's chunked hash
vector). Two prompts share ``chunk_hashes[:k]`` exactly when their first k chunks are equal.

Full chunks only, plus the final partial chunk: the partial chunk makes identical short
prompts (shorter than one chunk) still share a key, and it never matches a longer prompt's
full chunk because its bytes differ (a chunk's word count is part of what is hashed).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import xxhash

from skymesh.word_tokenizer import split_tokens

_SEP = b"\x1f"
_U64 = 0xFFFF_FFFF_FFFF_FFFF


def cumulative_hashes(chunks: Iterable[bytes]) -> tuple[int, ...]:
    """xxhash64 of each chunk seeded with the previous chunk's hash (0 for the first)."""
    out: list[int] = []
    prev = 0
    for chunk in chunks:
        prev = xxhash.xxh64_intdigest(chunk, seed=prev)
        out.append(prev)
    return tuple(out)


def chunk_hashes(tokens: Sequence[str], chunk_tokens: int) -> tuple[int, ...]:
    """Word chunks (the stand-in's word model and the trace replay)."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    return cumulative_hashes(_SEP.join(w.encode() for w in tokens[start : start + chunk_tokens])
                             for start in range(0, len(tokens), chunk_tokens))


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """Token ids as the bytes every token-id hash reads: unsigned 64-bit, native order."""
    return array("Q", (i & _U64 for i in ids)).tobytes()


def block_hash(token_ids: Sequence[int], parent: int) -> int:
    """One block of token ids, chained to its parent's hash: a KV-event block keyed this
    way equals the prompt's chunk from :func:`id_chunk_hashes` at the same position."""
    return xxhash.xxh64_intdigest(pack_token_ids(token_ids), seed=parent)


def id_chunk_hashes(ids: Sequence[int], chunk_tokens: int) -> tuple[int, ...]:
    """Cumulative hashes of ``chunk_tokens``-id chunks (the last one may be partial: two
    identical short prompts still share a key; its length is in its bytes, so it never
    equals a longer prompt's full chunk)."""
    packed = pack_token_ids(ids)
    step = 8 * chunk_tokens
    return cumulative_hashes(packed[k : k + step] for k in range(0, len(packed), step))


def byte_chunk_hashes(data: bytes, chunk_bytes: int) -> tuple[int, ...]:
    """Cumulative hashes of ``chunk_bytes``-byte chunks (the balancer without a tokenizer)."""
    return cumulative_hashes(data[k : k + chunk_bytes] for k in range(0, len(data), chunk_bytes))


def prompt_chunk_hashes(text: str, chunk_tokens: int) -> tuple[int, ...]:
    return chunk_hashes(split_tokens(text), chunk_tokens)


def key_hash(chunks: Sequence[int], length: int) -> int:
    """The ring key of a prompt's first ``length`` chunks (cumulative: just that hash)."""
    if not chunks:
        return 0
    return chunks[min(length, len(chunks)) - 1]
