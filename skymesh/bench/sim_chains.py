"""A trace request as the simulated engine and routing core see it: trace block ids
(``hash_ids``, one per 512-token block) turned into engine KV block hashes, routing chunk
hashes and, for the "events" cache view, prompt token ids.

Everything is deterministic in the ids (hashes of ints and tuples of ints do not depend on
PYTHONHASHSEED), so equal id prefixes give equal chains and nothing else does; pure
functions, apart from the simulator so they can be tested and reused on their own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

from skymesh.prompt_encoder import id_chunk_hashes
from skymesh.word_tokenizer import TRACE_BLOCK_TOKENS

_MASK = 0xFFFF_FFFF_FFFF_FFFF


def output_block_chain(prompt_blocks: list[int], hash_ids: Sequence[int], input_len: int, output_len: int,
                       block_size: int) -> list[int]:
    """Engine block hashes of the full blocks after the prompt's full blocks: the block
    the prompt's tail shares with the first output tokens, then output only. The stand-in
    generates the same filler for every request, so these depend only on the prompt (its
    full-block chain, and the tail's trace block and length) and the position, as the live
    stand-in's text hashes do; the engine caches them as vLLM caches generated blocks."""
    full = input_len // block_size
    if len(prompt_blocks) != full:
        return []  # the trace's ids do not cover the prompt: no hash to chain from
    tail = input_len % block_size
    tail_block = (full * block_size) // TRACE_BLOCK_TOKENS
    tail_id = hash_ids[tail_block] if tail and tail_block < len(hash_ids) else -1
    prev = prompt_blocks[-1] if prompt_blocks else 0
    out: list[int] = []
    for q in range(full, (input_len + output_len) // block_size):
        prev = hash((prev, tail_id, tail, q, 2)) & _MASK
        out.append(prev)
    return out


def block_chains(hash_ids: Iterable[int], input_len: int, block_size: int,
                 chunk_tokens: int) -> tuple[list[int], tuple[int, ...]]:
    """Engine block hashes (full blocks only) and routing chunk hashes from trace block ids:
    each 512-token trace block is ``512 / size`` sub-blocks, hashed deterministically and
    chained, so equal hash-id prefixes give equal chains and nothing else does."""
    ids = list(hash_ids)
    blocks: list[int] = []
    per_block = max(1, TRACE_BLOCK_TOKENS // block_size)
    full = input_len // block_size
    prev = 0
    for h in ids:
        for j in range(per_block):
            if len(blocks) >= full:
                break
            prev = hash((prev, h, j)) & _MASK
            blocks.append(prev)
    chunks: list[int] = []
    per_chunk = max(1, TRACE_BLOCK_TOKENS // chunk_tokens)
    n_chunks = -(-input_len // chunk_tokens)
    prev = 0
    for h in ids:
        for j in range(per_chunk):
            if len(chunks) >= n_chunks:
                break
            prev = hash((prev, h, j, 1)) & _MASK
            chunks.append(prev)
    return blocks, tuple(chunks)


VOCAB = 32_000
# the filler every request's answer is made of (the stand-in generates the same text for
# every request): output block hashes depend only on the prompt tail and the position
# (ints only: hash() of ints and tuples of ints does not depend on PYTHONHASHSEED)
_OUTPUT_FILLER = tuple(hash((-1, j)) % VOCAB for j in range(TRACE_BLOCK_TOKENS))


@functools.lru_cache(maxsize=1 << 12)  # ~18 KB a block: ~75 MB at most
def trace_block_ids(h: int) -> tuple[int, ...]:
    """The token ids of one 512-token trace block: deterministic in its hash id, so equal
    hash-id prefixes are equal token prefixes (and unequal ones differ from the first
    block on)."""
    return tuple(hash((h, j)) % VOCAB for j in range(TRACE_BLOCK_TOKENS))


def prompt_token_ids(hash_ids: Sequence[int], input_len: int, request_key: int) -> list[int]:
    """A trace request's prompt as token ids: its blocks' ids, cut to ``input_len``; a
    prompt longer than its ids (a trace that does not cover it) ends in tokens of its own."""
    ids: list[int] = []
    for h in hash_ids:
        if len(ids) >= input_len:
            break
        ids.extend(trace_block_ids(h))
    k = 0
    while len(ids) < input_len:
        ids.append(hash((-2, request_key, k)) % VOCAB)
        k += 1
    del ids[input_len:]
    return ids


def token_chains(prompt_ids: Sequence[int], output_len: int, block_size: int
                 ) -> tuple[list[int], tuple[int, ...], list[int]]:
    """For the "events" cache view: the engine's block hashes (full blocks of prompt +
    answer), the routing chunk hashes (the balancer's own :func:`id_chunk_hashes` over
    ``block_size``-token chunks, so the replicas' blocks are the balancer's chunks) and
    the token ids behind the blocks (KV events carry them)."""
    n_out = output_len
    out_ids = (_OUTPUT_FILLER * (n_out // len(_OUTPUT_FILLER) + 1))[:n_out]
    all_ids = [*prompt_ids, *out_ids]
    chunks = id_chunk_hashes(prompt_ids, block_size)
    full = len(all_ids) // block_size
    blocks = list(id_chunk_hashes(all_ids[: full * block_size], block_size))
    return blocks, chunks, all_ids
