"""Prompt chunk hashing: cumulative ids of prefixes, the partial last chunk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.hashing import chunk_hashes, key_hash, prompt_chunk_hashes
from skymesh.word_tokenizer import split_tokens

words = st.lists(st.sampled_from(["a", "b", "c", "ab", "<|user|>"]), max_size=40)


@settings(max_examples=60, deadline=None)
@given(a=words, b=words, chunk=st.integers(1, 8))
def test_equal_hash_prefixes_iff_equal_chunk_prefixes(a: list[str], b: list[str], chunk: int) -> None:
    ha, hb = chunk_hashes(a, chunk), chunk_hashes(b, chunk)
    for i in range(min(len(ha), len(hb))):
        same_chunks = a[: (i + 1) * chunk] == b[: (i + 1) * chunk]
        assert (ha[i] == hb[i]) == same_chunks


@settings(max_examples=40, deadline=None)
@given(tokens=words, chunk=st.integers(1, 8))
def test_one_hash_per_full_chunk_plus_the_partial_one(tokens: list[str], chunk: int) -> None:
    assert len(chunk_hashes(tokens, chunk)) == -(-len(tokens) // chunk)


def test_partial_last_chunk_never_matches_a_longer_prompts_full_chunk() -> None:
    short = chunk_hashes(["x"] * 3, 4)
    longer = chunk_hashes(["x"] * 4, 4)
    assert len(short) == len(longer) == 1 and short != longer
    assert chunk_hashes(["x"] * 3, 4) == short  # identical short prompts still share a key


def test_word_boundaries_are_part_of_the_hash() -> None:
    assert chunk_hashes(["ab", "c"], 2) != chunk_hashes(["a", "bc"], 2)


def test_a_different_first_chunk_changes_every_id() -> None:
    a = [f"w{i}" for i in range(40)]
    b = ["z"] + a[1:]
    assert all(x != y for x, y in zip(chunk_hashes(a, 8), chunk_hashes(b, 8), strict=True))


def test_prompt_text_uses_the_tokenizer_contract() -> None:
    text = "<|system|> be brief <|user|>  hello\nworld " * 20
    assert prompt_chunk_hashes(text, 16) == chunk_hashes(split_tokens(text), 16)
    assert prompt_chunk_hashes("", 16) == ()


def test_bad_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError):
        chunk_hashes(["a"], 0)


def test_key_hash_is_the_cumulative_id_of_the_first_chunks() -> None:
    h = chunk_hashes([f"w{i}" for i in range(10)], 2)
    assert key_hash(h, 1) == h[0] and key_hash(h, 3) == h[2]
    assert key_hash(h, 99) == h[-1]  # longer than the prompt: the whole prompt
    assert key_hash((), 3) == 0
