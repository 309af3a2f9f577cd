"""The stand-in's logprobs, in vLLM 0.32's shapes: a completion's ``{text_offset,
token_logprobs, tokens, top_logprobs}``, a chat's ``{content: [{token, logprob, bytes,
top_logprobs}]}`` and a completion choice's ``prompt_logprobs`` (with ``echo``).

The model is greedy-looking: every token (generated or, with ``echo``, of the prompt) is
its position's most likely one, rank 1, log-probability -ln 2; the others of the top
``k`` are deterministic other ids of the vocabulary at ranks 2, 3, ... (-r ln 2). As in
vLLM, a position's logprobs are a dict of the sampled token first, then the top ``k``:
with the sampled token ranked first that is ``max(k, 1)`` entries; a completion shows all
of them (OpenAI's "top k + 1"), a chat the first ``k``; a prompt's first token has none.
(vllm/entrypoints/openai/completion/serving.py ``_create_completion_logprobs``,
chat_completion/serving.py ``_create_chat_logprobs``, vllm/logprobs.py
``append_logprobs_for_next_position``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skymesh.replica_sim.tokenization import StandInTokenizer, rank_logprob
from skymesh.word_tokenizer import word_token_id

# vLLM 0.32's ModelConfig.max_logprobs default (--max-logprobs)
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Position:
    """One token of an answer: its text as vLLM decodes it alone, its id (or word), and
    whether it has logprobs (a prompt's first token has none)."""

    text: str
    token: str
    scored: bool = True


class LogprobsWriter:
    def __init__(self, tokens: StandInTokenizer) -> None:
        self.tokens = tokens

    def _ranked(self, p: Position, k: int) -> list[tuple[str, str, float]]:
        """(token, text, logprob) of the position's dict: the token itself, then the
        top-k's others (the token is the top 1)."""
        others = self.tokens.alternatives(p.token if p.token.isdecimal() else None, max(0, k - 1))
        return [(p.token, p.text, rank_logprob(1)),
                *((tok, text, rank_logprob(j + 2)) for j, (tok, text) in enumerate(others))]

    def completion(self, positions: list[Position], k: int, text_offset: int = 0) -> dict[str, Any]:
        """A completion choice's ``logprobs`` for ``positions`` (``logprobs: k``), the first
        at ``text_offset`` characters into the choice's text."""
        offsets: list[int] = []
        token_logprobs: list[float | None] = []
        strings: list[str] = []
        top: list[dict[str, float] | None] = []
        for p in positions:
            offsets.append(text_offset)
            text_offset += len(p.text)
            strings.append(p.text)
            if not p.scored:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(rank_logprob(1))
            entries: dict[str, float] = {}
            for _, text, lp in self._ranked(p, k):
                entries[text] = lp
            top.append(entries)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": strings, "top_logprobs": top}

    def chat(self, positions: list[Position], k: int) -> dict[str, Any]:
        """A chat choice's ``logprobs`` (``logprobs: true, top_logprobs: k``)."""
        content = []
        for p in positions:
            ranked = self._ranked(p, k)
            content.append({"token": p.text, "logprob": rank_logprob(1), "bytes": _utf8(p.text),
                            "top_logprobs": [{"token": text, "logprob": lp, "bytes": _utf8(text)}
                                             for _, text, lp in ranked[:k]]})
        return {"content": content}

    def prompt_logprobs(self, positions: list[Position], k: int) -> list[dict[str, dict[str, Any]] | None]:
        """``prompt_logprobs`` as vLLM serializes them: per prompt token ``None`` (the
        first) or ``{id: {logprob, rank, decoded_token}}``."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for p in positions:
            if not p.scored:
                out.append(None)
                continue
            entries: dict[str, dict[str, Any]] = {}
            for rank, (tok, text, lp) in enumerate(self._ranked(p, k), start=1):
                entries[str(word_token_id(tok))] = {"logprob": lp, "rank": rank, "decoded_token": text}
            out.append(entries)
        return out


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
