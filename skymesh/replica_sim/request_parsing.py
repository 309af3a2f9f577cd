"""Request parsing and validation for the stand-in's generation endpoints: a completion or
chat body becomes a :class:`GenRequest` (prompts as tokens, each prompt's output budget)
or an :class:`ApiError` with vLLM 0.32's message, ``param`` and status, checked in vLLM's
order, so a balancer sees the same refusals as from vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skymesh.replica_sim.tokenization import StandInTokenizer
from skymesh.word_tokenizer import GENERATION_PROMPT, ChatContentError, chat_prompt

# vLLM 0.32's CompletionRequest.max_tokens default (a null max_tokens is read as it too);
# a chat request has no default: it may fill the context (max_model_len - prompt tokens)
DEFAULT_MAX_TOKENS = 16
# vLLM's VLLM_MAX_COMPLETION_PROMPTS: the longest batch of prompts one completion takes
MAX_COMPLETION_PROMPTS = 1024


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def validation_error(message: str, parameter: str | None = None, value: Any = None) -> ApiError:
    """A 400 as vLLM 0.32 answers a ``VLLMValidationError``: the body's message is the
    exception's ``str()``, which appends ``(parameter=..., value=...)`` for whichever of
    the two is set, and ``param`` is the parameter (vllm/exceptions.py,
    entrypoints/serve/exception_handling/error_response.py)."""
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    return ApiError(f"{message} ({', '.join(extras)})" if extras else message, parameter)


@dataclass
class GenRequest:
    """A validated generation request: one engine request per prompt (a completion may
    carry a batch of prompts; a chat carries one)."""

    prompts: list[list[str]]
    max_tokens: list[int]  # per prompt, after vLLM's clamp to the context left
    stream: bool
    include_usage: bool

    @property
    def prompt_tokens(self) -> list[str]:
        """The (first) prompt's tokens."""
        return self.prompts[0]


def _int_param(body: dict[str, Any], key: str, default: int | None) -> int | None:
    """An integer field (its type only: vLLM checks the bounds later, in its own order)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(f"{key} must be an integer, got {type(v).__name__}", key)
    return v


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class _TextTokens(list[str]):
    """The tokens of a text prompt (vLLM tokenizes text with truncation, which changes how
    an over-long prompt's length is reported); token-id prompts are plain lists."""


def _bool_param(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{key} must be a boolean", key)
    return v


class RequestParser:
    """Parses bodies for the served ``model`` with a context of ``max_model_len`` tokens."""

    def __init__(self, model: str, max_model_len: int, tokens: StandInTokenizer) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.tokens = tokens

    def parse(self, body: Any, chat: bool) -> GenRequest:
        """Validate a request body the way vLLM 0.32 does, in its order: the request's own
        fields, the model, the output budget against the context, each prompt's length,
        then the sampling parameters with ``max_tokens`` clamped to the context left."""
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        max_len = self.max_model_len
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs
            ):
                raise ApiError("messages must be a non-empty list of {role, content} objects", "messages")
            try:
                text = chat_prompt(msgs)
            except ChatContentError as e:  # a content part vLLM would refuse too
                raise ApiError(str(e), e.param) from None
            # vLLM's chat templates end the prompt with the assistant's header
            # (add_generation_prompt, on by default), so the answer follows it: the next
            # turn's prompt, which holds the answer after that header, starts with this
            # turn's prompt and answer
            if _bool_param(body, "add_generation_prompt", True):
                text = f"{text} {GENERATION_PROMPT}" if text else GENERATION_PROMPT
            # a chat prompt carries its own special tokens (vLLM encodes a rendered chat
            # template without adding any), as the balancer encodes it too
            prompts = [self.tokens.text_tokens(text, special_tokens=False)]
            # max_completion_tokens first, max_tokens when it is null; none: no limit
            # but the context (vLLM's chat default)
            budget_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
                else "max_tokens"
            requested = _int_param(body, budget_param, None)
        else:
            prompts = self._prompts(body.get("prompt"))
            budget_param = "max_tokens"
            requested = _int_param(body, "max_tokens", DEFAULT_MAX_TOKENS)
        min_tokens = _int_param(body, "min_tokens", 0)
        assert min_tokens is not None
        _bool_param(body, "ignore_eos", False)  # the filler never emits EOS: lengths are exact
        n = _int_param(body, "n", 1)
        if n != 1:
            raise ApiError("the stand-in serves n=1 only", "n")
        stream = _bool_param(body, "stream", False)
        so = body.get("stream_options")
        if so is not None:
            if not stream:
                raise ApiError("Stream options can only be defined when `stream=True`.", "stream_options")
            if not isinstance(so, dict):
                raise ApiError("stream_options must be an object", "stream_options")
        include_usage = bool(so and _bool_param(so, "include_usage", False))
        model = body.get("model")
        if model is not None and model != self.model:  # vLLM serves a missing model too
            # vLLM 0.32 (entrypoints/serve/engine/serving.py _check_model) names what it serves
            raise ApiError(f"The model `{model}` does not exist. Valid aliases: {self.model}.", "model", 404)
        # the renderer's TokenizeParams (vllm/renderers/params.py): an output budget
        # longer than the whole context is refused before any prompt is looked at
        if requested is not None and requested > max_len:
            raise validation_error(f"{budget_param}={requested} cannot be greater than max_model_len="
                                   f"{max_len}. Please request fewer output tokens.", budget_param, requested)
        for tokens in prompts:
            self._check_prompt_length(tokens, text_prompt=chat or isinstance(tokens, _TextTokens))
        budgets: list[int] = []
        for tokens in prompts:
            # vllm/entrypoints/serve/utils/api_utils.py get_max_tokens: the request's
            # budget (or the default) never past the context the prompt leaves
            left = max_len - len(tokens)
            budget = left if requested is None else min(left, requested)
            # SamplingParams: the clamped budget is what is checked
            if budget < 1:
                raise validation_error(f"max_tokens must be at least 1, got {budget}.", "max_tokens", budget)
            if min_tokens < 0:
                raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
            if min_tokens > budget:
                raise ApiError(f"min_tokens must be less than or equal to max_tokens={budget}, got {min_tokens}.")
            budgets.append(budget)
        return GenRequest(prompts, budgets, stream, include_usage)

    def _check_prompt_length(self, tokens: list[str], text_prompt: bool) -> None:
        """vLLM 0.32 refuses a prompt only when it alone is longer than the context
        (TokenizeParams._token_len_check). A text prompt is tokenized with truncation at
        max_model_len + 1, so its count stops there and reads "at least"; token ids are
        counted as given."""
        max_len = self.max_model_len
        if len(tokens) <= max_len:
            if not tokens:
                raise ApiError("The decoder prompt cannot be empty")
            return
        count = min(len(tokens), max_len + 1) if text_prompt else len(tokens)
        qualifier = "at least " if count == max_len + 1 else ""
        raise validation_error(
            f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
            f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.", "input_tokens", count)

    def _prompts(self, prompt: Any) -> list[list[str]]:
        """The prompts of a completion request, as vLLM's ``CompletionRequest.prompt``
        takes them: a string, a list of strings, a list of token ids, or a list of lists of
        token ids (one prompt each). Token ids keep their identity as words (``"17"``), so
        prefix caching still sees equal prefixes."""
        if prompt is None or prompt == "":
            raise validation_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str):
            return [_TextTokens(self.tokens.text_tokens(prompt))]
        if not isinstance(prompt, list):
            raise ApiError("prompt must be a string, a list of strings, a list of token ids, "
                           "or a list of lists of token ids", "prompt")
        if prompt and all(_is_token_id(x) for x in prompt):
            return [[str(x) for x in prompt]]
        if len(prompt) > MAX_COMPLETION_PROMPTS:
            raise validation_error(f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                                   f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
                                   "VLLM_MAX_COMPLETION_PROMPTS environment variable.", "prompt")
        if all(isinstance(x, str) for x in prompt):
            return [_TextTokens(self.tokens.text_tokens(x)) for x in prompt]
        if all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in prompt):
            return [[str(t) for t in x] for x in prompt]
        raise ApiError("prompt must be a string, a list of strings, a list of token ids (>= 0), "
                       "or a list of lists of token ids", "prompt")
