"""The model's context window, checked at the edge as vLLM 0.32 checks it.

A request that cannot fit the model is answered by the balancer with vLLM's own 400 (the
same message and ``param``) before any replica sees it, so one oversized prompt never
costs a replica its tokenizer thread, its health or its place in the fleet. vLLM's checks
(``vllm/renderers/params.py`` TokenizeParams, ``entrypoints/serve/utils/api_utils.py``
get_max_tokens), in its order:

1. an output budget longer than the whole context (``max_tokens`` or
   ``max_completion_tokens`` > ``max_model_len``);
2. each prompt longer than the context on its own: a text longer than ``max_model_len``
   times the tokenizer's longest vocabulary entry, in characters, without tokenizing it
   (``TokenizeParams._text_len_check``, on the API server's loop: what that many tokens
   can spell at most); else a text prompt is tokenized with
   truncation at ``max_model_len + 1``, so its count reads "at least max_model_len + 1";
   a token-id prompt's count is its length;
3. a prompt that leaves no room for one output token (exactly ``max_model_len`` tokens:
   the budget clamps to 0). A prompt plus a ``max_tokens`` over the context is *not*
   refused: vLLM clamps the budget to the context left.

The balancer makes the character check with the same bound (read off the same
tokenizer), so a 4 MB prompt costs it the check's microseconds, and what it does tokenize
is bounded by that many characters.

The messages are vLLM 0.32's (``VLLMValidationError``'s ``str()`` appends
``(parameter=..., value=...)``); the stand-in (skymesh/replica_sim/request_parsing.py)
builds its refusals from these same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skymesh.edge.openai_errors import RequestError


def validation_message(message: str, parameter: str | None = None, value: Any = None) -> str:
    """vLLM 0.32's ``VLLMValidationError`` as its error body says it: the message, then
    ``(parameter=..., value=...)`` for whichever of the two is set."""
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    return f"{message} ({', '.join(extras)})" if extras else message


def budget_over_context_message(budget_param: str, requested: int, max_model_len: int) -> str:
    return validation_message(f"{budget_param}={requested} cannot be greater than max_model_len="
                              f"{max_model_len}. Please request fewer output tokens.", budget_param, requested)


def text_over_context_message(chars: int, max_model_len: int, max_chars: int) -> str:
    """vLLM's refusal of a text whose characters alone exceed what the context can hold."""
    return validation_message(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{chars} characters (more than {max_chars} characters, which is the upper bound for {max_model_len} "
        "input tokens). Please reduce the length of the input prompt.", "input_text", chars)


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
    ("budget": the output budget alone, "chars": the prompt's characters, "tokens": its
    token count)."""

    def __init__(self, message: str, param: str, proved_by: str) -> None:
        super().__init__(400, message, param=param)
        self.proved_by = proved_by


@dataclass(frozen=True, slots=True)
class ContextWindow:
    """One model's context (``max_model_len`` tokens) and its tokenizer's longest
    vocabulary entry in characters (None: not known, no text check)."""

    max_model_len: int
    max_chars_per_token: int | None = None

    @property
    def max_prompt_chars(self) -> int | None:
        """The longest text vLLM tokenizes: past it, the characters alone refuse it."""
        return None if self.max_chars_per_token is None else self.max_model_len * self.max_chars_per_token

    def check_budget(self, budget_param: str, requested: int | None) -> None:
        """vLLM's first check: an output budget longer than the whole context."""
        if requested is not None and requested > self.max_model_len:
            raise ContextRefusal(budget_over_context_message(budget_param, requested, self.max_model_len),
                                 budget_param, "budget")

    def check_text(self, chars: int) -> None:
        """vLLM's check before tokenizing: a text of ``chars`` characters longer than the
        context's tokens can spell."""
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise ContextRefusal(text_over_context_message(chars, self.max_model_len, limit), "input_text", "chars")

    def check_prompt(self, tokens: int, *, text: bool) -> None:
        """vLLM's check after tokenizing: one prompt longer than the context on its own
        (a text is counted up to ``max_model_len + 1``, so its count reads "at least")."""
        if tokens > self.max_model_len:
            count = min(tokens, self.max_model_len + 1) if text else tokens
            raise ContextRefusal(prompt_over_context_message(count, self.max_model_len), "input_tokens", "tokens")

    def check_room(self, tokens: int, requested: int | None) -> None:
        """vLLM's last check: the budget, clamped to the context the prompt leaves, is
        below one token (only a prompt of exactly ``max_model_len`` tokens gets here)."""
        left = self.max_model_len - tokens
        budget = left if requested is None else min(left, requested)
        if budget < 1:
            raise ContextRefusal(budget_too_small_message(budget), "max_tokens", "tokens")


def max_chars_per_token(tokenizer: Any) -> int | None:
    """vLLM's ``max_chars_per_token`` of an HF ``tokenizers.Tokenizer``: its longest
    vocabulary entry (added tokens included), in characters as the vocabulary spells it
    (``vllm/tokenizers/hf.py`` get_cached_tokenizer); None for an empty vocabulary."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(piece) for piece in vocab), default=None)
