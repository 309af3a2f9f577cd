"""How the stand-in counts and hashes tokens: whitespace words (skymesh/word_tokenizer.py),
or with a local HF ``tokenizer.json`` the model's token ids, kept as decimal strings so the
engine's block hashes and the KV events' ``token_ids`` are the tokenizer's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skymesh.word_tokenizer import filler_tokens, split_tokens


class StandInTokenizer:
    """Words, or the ids of the HF tokenizer loaded from ``tokenizer`` (a tokenizer.json)."""

    def __init__(self, tokenizer: str | Path | None = None) -> None:
        self.tokenizer: Any = None
        # the id of every generated token with a tokenizer (the filler's text " tok<i>"
        # is not one token of a real vocabulary; its first piece stands for each)
        self._generated_id = "0"
        if tokenizer is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tokenizer))
            ids = self.tokenizer.encode(" tok", add_special_tokens=False).ids
            self._generated_id = str(ids[0] if ids else 0)

    def text_tokens(self, text: str, special_tokens: bool = True) -> list[str]:
        """A text's tokens: its words, or its token ids (as decimal strings) with a
        tokenizer, special tokens (BOS) added as vLLM adds them to a completion prompt."""
        if self.tokenizer is None:
            return split_tokens(text)
        return [str(i) for i in self.tokenizer.encode(text, add_special_tokens=special_tokens).ids]

    def filler_hash_tokens(self, n: int) -> list[str]:
        """The output's tokens as the engine hashes them (generated blocks are cached)."""
        if self.tokenizer is None:
            return filler_tokens(n)
        return [self._generated_id] * n
