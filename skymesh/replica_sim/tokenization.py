"""How the stand-in counts, hashes and writes tokens: whitespace words
(skymesh/word_tokenizer.py), or with a local HF ``tokenizer.json`` the model's token ids,
kept as decimal strings so the engine's block hashes and the KV events' ``token_ids`` are
the tokenizer's.

With a tokenizer, generated text is one piece repeated (``" the"`` with the shipped
tokenizer) that encodes to exactly one id per repetition, so a client that tokenizes the
completion with the same tokenizer counts exactly ``completion_tokens``; it is chosen and
checked when the tokenizer loads. A tokenizer with no such piece keeps the word filler
(`` tok<i>``, each counted as one id), which its clients then count otherwise (logged).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from skymesh.context_window import max_chars_per_token
from skymesh.word_tokenizer import filler_tokens, split_tokens

log = logging.getLogger("skymesh.replica_sim")

# pieces tried first for the generated text: common words, one id each in most BPE
# vocabularies; then the vocabulary is scanned
GENERATED_PIECES = (" the", " a", " and", " of", " to", " is", " it", " tok", " x")
# how many ids of the vocabulary are tried as the piece when none of the above holds
VOCAB_SCAN = 4096
# how many ids of the vocabulary are looked at for the top logprobs' other entries
# (decoded once, on the first request asking for logprobs)
READABLE_SCAN = 32768
# a token's log-probability by its rank r (1 = the sampled one): -r ln 2, so the ranks'
# probabilities 1/2, 1/4, ... never sum past 1
LN2 = math.log(2.0)
# the "vocabulary" of the word model, for logprobs=-1 (every token): ids reach 2**32
WORD_VOCAB = 1 << 32


def rank_logprob(rank: int) -> float:
    return -rank * LN2


def _one_id_per_repeat(tok: Any, piece: str) -> int | None:
    """The id ``piece`` encodes to when repeating it encodes to that id once per repeat
    and the ids decode back to the repeated text; None otherwise."""
    one = tok.encode(piece, add_special_tokens=False).ids
    if len(one) != 1:
        return None
    for n in (2, 5, 17):
        if tok.encode(piece * n, add_special_tokens=False).ids != one * n:
            return None
        if tok.decode(one * n, skip_special_tokens=False) != piece * n:
            return None
    return int(one[0])


def generated_piece(tok: Any) -> tuple[str, int] | None:
    """(piece, id) for the generated text, or None when the tokenizer has none."""
    for piece in GENERATED_PIECES:
        token_id = _one_id_per_repeat(tok, piece)
        if token_id is not None:
            return piece, token_id
    special = set(tok.get_added_tokens_decoder())
    for token_id in range(min(VOCAB_SCAN, tok.get_vocab_size())):
        if token_id in special:
            continue
        piece = tok.decode([token_id], skip_special_tokens=False)
        if piece.strip() and _one_id_per_repeat(tok, piece) == token_id:
            return piece, token_id
    return None


class StandInTokenizer:
    """Words, or the ids of the HF tokenizer loaded from ``tokenizer`` (a tokenizer.json)."""

    def __init__(self, tokenizer: str | Path | None = None) -> None:
        self.tokenizer: Any = None
        # the text and id of every generated token
        self.piece: str | None = None
        self._generated_id = "0"
        self.vocab_size = WORD_VOCAB
        self._readable: list[int] | None = None
        # vLLM's max_chars_per_token (its character check before tokenizing); words: none
        self.max_chars_per_token: int | None = None
        if tokenizer is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tokenizer))
            self.vocab_size = self.tokenizer.get_vocab_size()
            self.max_chars_per_token = max_chars_per_token(self.tokenizer)
            found = generated_piece(self.tokenizer)
            if found is not None:
                self.piece, token_id = found
                self._generated_id = str(token_id)
            else:
                # the filler's text " tok<i>" is then no single token; its first piece
                # stands for each (clients counting the text get other numbers)
                ids = self.tokenizer.encode(" tok", add_special_tokens=False).ids
                self._generated_id = str(ids[0] if ids else 0)
                log.warning("tokenizer %s: no piece encodes to one id per repetition; generated text is "
                            "' tok<i>' words, which clients count as more tokens than reported", tokenizer)

    def text_tokens(self, text: str, special_tokens: bool = True) -> list[str]:
        """A text's tokens: its words, or its token ids (as decimal strings) with a
        tokenizer, special tokens (BOS) added as vLLM adds them to a completion prompt."""
        if self.tokenizer is None:
            return split_tokens(text)
        # the batch call, as vLLM's tokenizer call makes it: it releases the GIL, so the
        # server's loop (/health, /metrics, streams) runs while a long prompt is encoded
        return [str(i) for i in self.tokenizer.encode_batch([text], add_special_tokens=special_tokens)[0].ids]

    def filler_hash_tokens(self, n: int) -> list[str]:
        """The output's tokens as the engine hashes them (generated blocks are cached)."""
        if self.tokenizer is None:
            return filler_tokens(n)
        return [self._generated_id] * n

    # ------------------------------------------------------------------ generated text

    def generated_strings(self, start: int, n: int) -> list[str]:
        """The text of generated tokens ``start`` .. ``start + n - 1``, one string each
        (vLLM's streamed deltas and its logprobs' decoded tokens)."""
        if self.piece is not None:
            return [self.piece] * n
        return [" " + w for w in filler_tokens(n, start)]

    def generated_text(self, start: int, n: int) -> str:
        return "".join(self.generated_strings(start, n))

    def generated_id(self, position: int) -> int | None:
        """The token id of generated token ``position`` (None in the word model, whose
        filler words are no ids)."""
        if self.tokenizer is None:
            return None
        return int(self._generated_id)

    # ------------------------------------------------------------------ prompt tokens

    def token_string(self, token: str) -> str:
        """One prompt token as vLLM's logprobs show it: the id decoded alone (special
        tokens kept, BOS reads ``<s>``); a word as it is."""
        if self.tokenizer is None or not token.isdecimal():
            return token
        return self.tokenizer.decode([int(token)], skip_special_tokens=False)

    def decode(self, tokens: list[str]) -> str:
        """The text of token-id prompt tokens (what vLLM echoes for a token-id prompt:
        special tokens skipped); words joined by spaces."""
        if self.tokenizer is None:
            return " ".join(tokens)
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)

    def alternatives(self, token: str | None, k: int) -> list[tuple[str, str]]:
        """(token, text) of ``k`` tokens ranked after ``token`` (the top logprobs' other
        entries): deterministic other ids of the vocabulary, decoded alone; in the word
        model the words ``alt<j>``."""
        if self.tokenizer is None or token is None:
            return [(f"alt{j}", f" alt{j}") for j in range(1, k + 1)]
        readable = self._readable_ids()
        base = int(token)
        out = []
        for j in range(1, k + 1):
            other = readable[(base + 7919 * j) % len(readable)]
            if other == base:
                other = readable[(base + 7919 * j + 1) % len(readable)]
            out.append((str(other), self.tokenizer.decode([other], skip_special_tokens=False)))
        return out

    def _readable_ids(self) -> list[int]:
        """The vocabulary's ids that decode alone to whole, printable text (no special
        token, no partial UTF-8 character): the alternatives' candidates."""
        if self._readable is None:
            special = set(self.tokenizer.get_added_tokens_decoder())
            ids = []
            for token_id in range(min(self.vocab_size, READABLE_SCAN)):
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
                if token_id not in special and text.strip() and text.isprintable() and "\ufffd" not in text:
                    ids.append(token_id)
            self._readable = ids or list(range(self.vocab_size))
        return self._readable
