"""The model's context window, checked at the edge as vLLM 0.32 checks it.

A request that cannot fit the model is answered by the balancer with vLLM's own 400 (the
same message and ``param``) before any replica sees it, so one oversized prompt never
costs a replica its tokenizer thread, its health or its place in the fleet. vLLM's checks
(``vllm/renderers/params.py`` TokenizeParams, ``entrypoints/serve/utils/api_utils.py``
get_max_tokens), in its order:

1. an output budget longer than the whole context (``max_tokens`` or
   ``max_completion_tokens`` > ``max_model_len``);
2. each prompt longer than the context on its own: a text prompt is tokenized with
   truncation at ``max_model_len + 1``, so its count reads "at least max_model_len + 1";
   a token-id prompt's count is its length;
3. a prompt that leaves no room for one output token (exactly ``max_model_len`` tokens:
   the budget clamps to 0). A prompt plus a ``max_tokens`` over the context is *not*
   refused: vLLM clamps the budget to the context left.

The work is bounded before it is done: a text whose UTF-8 length alone proves it longer
than the context (more than ``max_model_len * max_token_bytes`` bytes, where
``max_token_bytes`` is the most bytes one token of the model's vocabulary stands for) is
refused without tokenizing it; its message is the one vLLM's truncating tokenizer gives
("at least max_model_len + 1"), so the answer is the same either way.

The messages are vLLM 0.32's (``VLLMValidationError``'s ``str()`` appends
``(parameter=..., value=...)``); the stand-in (skymesh/replica_sim/request_parsing.py)
builds its refusals from these same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skymesh.edge.openai_errors import RequestError

# the bound of one token's bytes where the model's vocabulary is not known (no
# tokenizer.json, or one that does not keep every byte): generous, so that only a prompt
# vLLM refuses too is refused on its length alone (32768 tokens x 64 bytes = 2 MiB)
DEFAULT_MAX_TOKEN_BYTES = 64
# texts a tokenizer must give back byte for byte before its vocabulary bounds a prompt's
# length (a normalizer or pre-tokenizer that drops whitespace or accents would make a long
# text few tokens, and the byte bound unsound)
_ROUND_TRIP_PROBES = ("  two  spaces\n\n\ttab", "Café naïve Ångström ﬁ", "東京の天気は？ 😀", "\x00\x01 \r\n")


def validation_message(message: str, parameter: str | None = None, value: Any = None) -> str:
    """vLLM 0.32's ``VLLMValidationError`` as its error body says it: the message, then
    ``(parameter=..., value=...)`` for whichever of the two is set."""
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    return f"{message} ({', '.join(extras)})" if extras else message


def budget_over_context_message(budget_param: str, requested: int, max_model_len: int) -> str:
    return validation_message(f"{budget_param}={requested} cannot be greater than max_model_len="
                              f"{max_model_len}. Please request fewer output tokens.", budget_param, requested)


def prompt_over_context_message(count: int, max_model_len: int) -> str:
    """``count`` is ``max_model_len + 1`` for a text prompt (vLLM truncates there, and says
    "at least"), the prompt's length for token ids."""
    qualifier = "at least " if count == max_model_len + 1 else ""
    return validation_message(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt.", "input_tokens", count)


def budget_too_small_message(budget: int) -> str:
    return validation_message(f"max_tokens must be at least 1, got {budget}.", "max_tokens", budget)


class ContextRefusal(RequestError):
    """vLLM's 400 for a request that cannot fit the model; ``proved_by``: what showed it
    ("budget": the output budget alone, "bytes": the prompt's UTF-8 length, "tokens":
    its token count)."""

    def __init__(self, message: str, param: str, proved_by: str) -> None:
        super().__init__(400, message, param=param)
        self.proved_by = proved_by


@dataclass(frozen=True, slots=True)
class ContextWindow:
    """One model's context (``max_model_len`` tokens) and the bound of one token's bytes."""

    max_model_len: int
    max_token_bytes: int = DEFAULT_MAX_TOKEN_BYTES

    @property
    def max_prompt_bytes(self) -> int:
        """The longest UTF-8 text that may still fit: past it, the bytes alone prove the
        prompt longer than the context."""
        return self.max_model_len * self.max_token_bytes

    def check_budget(self, budget_param: str, requested: int | None) -> None:
        """vLLM's first check: an output budget longer than the whole context."""
        if requested is not None and requested > self.max_model_len:
            raise ContextRefusal(budget_over_context_message(budget_param, requested, self.max_model_len),
                                 budget_param, "budget")

    def check_text_bytes(self, utf8_bytes: int) -> None:
        """A text prompt of ``utf8_bytes`` bytes whose length alone proves it too long."""
        if utf8_bytes > self.max_prompt_bytes:
            self._prompt_over(self.max_model_len + 1, "bytes")

    def check_prompt(self, tokens: int, *, text: bool) -> None:
        """vLLM's second check: one prompt longer than the context on its own."""
        if tokens > self.max_model_len:
            self._prompt_over(min(tokens, self.max_model_len + 1) if text else tokens, "tokens")

    def check_room(self, tokens: int, requested: int | None) -> None:
        """vLLM's third check: the budget, clamped to the context the prompt leaves, is
        below one token (only a prompt of exactly ``max_model_len`` tokens gets here)."""
        left = self.max_model_len - tokens
        budget = left if requested is None else min(left, requested)
        if budget < 1:
            raise ContextRefusal(budget_too_small_message(budget), "max_tokens", "tokens")

    def _prompt_over(self, count: int, proved_by: str) -> None:
        raise ContextRefusal(prompt_over_context_message(count, self.max_model_len), "input_tokens", proved_by)


def max_token_bytes(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes one token of ``tokenizer`` (an HF ``tokenizers.Tokenizer``)
    stands for, read off its vocabulary; an upper bound (a byte-level BPE's ``Ġ`` is two
    bytes in the vocabulary and one in the text). None when the tokenizer does not give
    every probe text back byte for byte: it may drop bytes, so no bound holds."""
    for probe in _ROUND_TRIP_PROBES:
        ids = tokenizer.encode(probe, add_special_tokens=False).ids
        if tokenizer.decode(ids, skip_special_tokens=False) != probe:
            return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(piece.encode("utf-8")) for piece in vocab), default=None)
