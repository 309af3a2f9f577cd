"""Request parsing and validation for the stand-in's generation endpoints: a completion or
chat body becomes a :class:`GenRequest` (prompts as tokens, each prompt's output budget)
or an :class:`ApiError` with vLLM 0.32's message, ``param`` and status, checked in vLLM's
order, so a balancer sees the same refusals as from vLLM."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from skymesh.context_window import (
    budget_over_context_message,
    budget_too_small_message,
    prompt_over_context_message,
    text_over_context_message,
    validation_message,
)
from skymesh.replica_sim.logprobs import MAX_LOGPROBS
from skymesh.replica_sim.tokenization import StandInTokenizer
from skymesh.word_tokenizer import GENERATION_PROMPT, ChatContentError, chat_prompt

# vLLM 0.32's CompletionRequest.max_tokens default (a null max_tokens is read as it too);
# a chat request has no default: it may fill the context (max_model_len - prompt tokens)
DEFAULT_MAX_TOKENS = 16
# vLLM's VLLM_MAX_COMPLETION_PROMPTS: the longest batch of prompts one completion takes
MAX_COMPLETION_PROMPTS = 1024
# vLLM's VLLM_MAX_N_SEQUENCES: the most choices (n) one request takes
MAX_N_SEQUENCES = 16384
# SamplingParams: a temperature below this is greedy sampling, which takes n = 1 only
SAMPLING_EPS = 1e-5


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        # the body's error type when not the status's usual one (a pydantic refusal's is
        # the status phrase, "Bad Request")
        self.kind = kind


def _summarized_input(value: Any) -> str:
    """A pydantic error's ``input`` as vLLM's validation handler bounds it
    (entrypoints/serve/exception_handling/handlers/validation.py)."""
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, bool) else str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


def dict_field_error(name: str, value: Any) -> ApiError:
    """The 400 vLLM's FastAPI app answers when a ``dict[str, Any] | None`` field of the
    request model gets something else: one pydantic ``dict_type`` error."""
    err = {"type": "dict_type", "loc": f"body.{name}", "msg": "Input should be a valid dictionary",
           "input": _summarized_input(value)}
    return ApiError(f"1 validation error:\n  {err}", f"body.{name}", kind="Bad Request")


def validation_error(message: str, parameter: str | None = None, value: Any = None) -> ApiError:
    """A 400 as vLLM 0.32 answers a ``VLLMValidationError``: the body's message is the
    exception's ``str()``, which appends ``(parameter=..., value=...)`` for whichever of
    the two is set, and ``param`` is the parameter (vllm/exceptions.py,
    entrypoints/serve/exception_handling/error_response.py)."""
    return ApiError(validation_message(message, parameter, value), parameter)


@dataclass
class GenRequest:
    """A validated generation request: one engine request per prompt (a completion may
    carry a batch of prompts; a chat carries one)."""

    prompts: list[list[str]]
    max_tokens: list[int]  # per prompt, after vLLM's clamp to the context left
    stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt
    # the logprobs each generated token carries (a completion's logprobs, a chat's
    # top_logprobs when its logprobs is true); None: no logprobs
    logprobs: int | None = None
    # the prompt tokens' logprobs (vLLM computes them for echo: a completion's logprobs,
    # a chat's top_logprobs)
    prompt_logprobs: int | None = None
    echo: bool = False
    # a completion with echo and max_tokens 0: the answer is the prompt alone (vLLM
    # still generates one token, counted in usage)
    echo_only: bool = False
    # per prompt, the text a completion's echo writes (the prompt as sent; a token-id
    # prompt decoded)
    prompt_texts: list[str] = field(default_factory=list)
    # a chat's echo: the last message's content when it is the answer's role
    chat_echo: str = ""
    # a chat answer's role: the assistant's, or without the generation prompt the last
    # message's (vLLM's get_chat_request_role)
    role: str = "assistant"
    # vLLM's kv_transfer_params (a dict or None, checked by the request model)
    kv_transfer_params: dict[str, Any] | None = None
    # a decode leg's answer reports the prefill replica's cache hits (vLLM's
    # remote_prefill_cached_tokens) as its cached prompt tokens
    remote_prefill_cached_tokens: int | None = None

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
    an over-long prompt's length is reported); token-id prompts are plain lists.
    ``over_chars``: the text's length when vLLM's character check refuses it: it was not
    tokenized (the refusal is said where vLLM checks prompt lengths)."""

    over_chars: int | None = None


def _logprobs_param(body: dict[str, Any], key: str) -> int | None:
    """``logprobs`` (completion) or ``top_logprobs`` (chat, null read as 0) checked as
    vLLM's ``check_logprobs`` does, before pydantic types it."""
    v = body.get(key)
    if v is None:
        return 0 if key == "top_logprobs" else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise validation_error(f"`{key}` must be an integer.", key, v)
    if v < 0 and v != -1:
        raise validation_error(f"`{key}` must be a positive value or -1.", key, v)
    if not isinstance(v, int):
        raise ApiError(f"{key} must be an integer, got {type(v).__name__}", key)
    return v


def _answer_role(msgs: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return "assistant" if add_generation_prompt else str(msgs[-1]["role"])


def _chat_echo(msgs: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """What a chat's ``echo`` puts before the answer: the last message's content when its
    role is the answer's (``assistant`` with the generation prompt, else the last
    message's own), content parts' texts joined by newlines."""
    last = msgs[-1]
    if last.get("role") != _answer_role(msgs, add_generation_prompt):
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "\n".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content
                         if isinstance(p, str) or (isinstance(p, dict) and p.get("type") in ("text", "input_text")))
    return content if isinstance(content, str) else ""


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
        # the request model's own types come first (pydantic, before any of vLLM's checks)
        kv_params = body.get("kv_transfer_params")
        if kv_params is not None and not isinstance(kv_params, dict):
            raise dict_field_error("kv_transfer_params", kv_params)
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
            add_generation_prompt = _bool_param(body, "add_generation_prompt", True)
            if add_generation_prompt:
                text = f"{text} {GENERATION_PROMPT}" if text else GENERATION_PROMPT
            # a chat prompt carries its own special tokens (vLLM encodes a rendered chat
            # template without adding any), as the balancer encodes it too
            prompts = [self._text(text, special_tokens=False)]
            # max_completion_tokens first, max_tokens when it is null; none: no limit
            # but the context (vLLM's chat default)
            budget_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
                else "max_tokens"
            requested = _int_param(body, budget_param, None)
            prompt_texts: list[str] = []
        else:
            prompts = self._prompts(body.get("prompt"))
            budget_param = "max_tokens"
            requested = _int_param(body, "max_tokens", DEFAULT_MAX_TOKENS)
            prompt_texts = self._prompt_texts(body.get("prompt"), prompts)
        min_tokens = _int_param(body, "min_tokens", 0)
        assert min_tokens is not None
        _bool_param(body, "ignore_eos", False)  # the filler never emits EOS: lengths are exact
        n = _int_param(body, "n", 1)
        assert n is not None
        stream = _bool_param(body, "stream", False)
        so = body.get("stream_options")
        if so is not None:
            if not stream:
                raise ApiError("Stream options can only be defined when `stream=True`.", "stream_options")
            if not isinstance(so, dict):
                raise ApiError("stream_options must be an object", "stream_options")
        include_usage = bool(so and _bool_param(so, "include_usage", False))
        # the protocol's check_logprobs (after its stream_options check), then echo's type
        if chat:
            with_logprobs = _bool_param(body, "logprobs", False)
            top = _logprobs_param(body, "top_logprobs")
            if top and not with_logprobs:
                raise validation_error("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
            logprobs = top if with_logprobs else None
            echo = _bool_param(body, "echo", False)
            prompt_logprobs = top if echo else None
            chat_echo = _chat_echo(msgs, add_generation_prompt) if echo else ""
            role = _answer_role(msgs, add_generation_prompt)
        else:
            logprobs = _logprobs_param(body, "logprobs")
            echo = _bool_param(body, "echo", False)
            prompt_logprobs = logprobs if echo else None
            chat_echo = ""
            role = "assistant"
        temperature = body.get("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
            raise ApiError(f"temperature must be a number, got {type(temperature).__name__}", "temperature")
        model = body.get("model")
        if model is not None and model != self.model:  # vLLM serves a missing model too
            # vLLM 0.32 (entrypoints/serve/engine/serving.py _check_model) names what it serves
            raise ApiError(f"The model `{model}` does not exist. Valid aliases: {self.model}.", "model", 404)
        # the renderer's TokenizeParams (vllm/renderers/params.py): an output budget
        # longer than the whole context is refused before any prompt is looked at
        if requested is not None and requested > max_len:
            raise ApiError(budget_over_context_message(budget_param, requested, max_len), budget_param)
        for tokens in prompts:
            self._check_prompt_length(tokens, text_prompt=chat or isinstance(tokens, _TextTokens))
        budgets: list[int] = []
        # a completion's echo without generation: vLLM samples one token it does not show
        echo_only = echo and not chat and requested == 0
        for tokens in prompts:
            # vllm/entrypoints/serve/utils/api_utils.py get_max_tokens: the request's
            # budget (or the default) never past the context the prompt leaves
            left = max_len - len(tokens)
            budget = left if requested is None else min(left, requested)
            if echo_only:
                budget = 1
            # SamplingParams (its _verify_args order): n, then the clamped budget
            if n < 1:
                raise ApiError(f"n must be at least 1, got {n}.")
            if n > MAX_N_SEQUENCES:
                raise ApiError(f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, "
                               "set the VLLM_MAX_N_SEQUENCES environment variable.")
            if budget < 1:
                raise ApiError(budget_too_small_message(budget), "max_tokens")
            if min_tokens < 0:
                raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
            if min_tokens > budget:
                raise ApiError(f"min_tokens must be less than or equal to max_tokens={budget}, got {min_tokens}.")
            if temperature is not None and temperature < SAMPLING_EPS and n > 1:
                raise ApiError(f"n must be 1 when using greedy sampling, got {n}.")
            budgets.append(budget)
        # SamplingParams.verify, in the engine's input processing: at most
        # --max-logprobs (20); -1 asks for the whole vocabulary
        if logprobs:
            wanted = self.tokens.vocab_size if logprobs == -1 else logprobs
            if wanted > MAX_LOGPROBS:
                raise validation_error(f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
                                       f"{MAX_LOGPROBS}", "logprobs", wanted)
        return GenRequest(prompts, budgets, stream, include_usage, n=n, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs, echo=echo, echo_only=echo_only,
                          prompt_texts=prompt_texts, chat_echo=chat_echo, role=role, kv_transfer_params=kv_params)

    def _prompt_texts(self, prompt: Any, prompts: list[list[str]]) -> list[str]:
        """Each prompt's text as a completion's echo writes it: a text prompt as sent, a
        token-id prompt decoded (vLLM detokenizes it for echo)."""
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and all(isinstance(x, str) for x in prompt):
            return list(prompt)
        return [self.tokens.decode(tokens) for tokens in prompts]

    def _text(self, text: str, special_tokens: bool = True) -> _TextTokens:
        """A text prompt's tokens, unless vLLM's character check (``_text_len_check``: more
        characters than ``max_model_len`` tokens of the tokenizer's longest entry can
        spell) refuses it first: then it is never tokenized, as vLLM never tokenizes it."""
        limit = self.tokens.max_chars_per_token
        if limit is not None and len(text) > self.max_model_len * limit:
            refused = _TextTokens()
            refused.over_chars = len(text)
            return refused
        return _TextTokens(self.tokens.text_tokens(text, special_tokens=special_tokens))

    def _check_prompt_length(self, tokens: list[str], text_prompt: bool) -> None:
        """vLLM 0.32 refuses a prompt only when it alone is longer than the context
        (TokenizeParams._token_len_check). A text prompt is tokenized with truncation at
        max_model_len + 1, so its count stops there and reads "at least"; token ids are
        counted as given."""
        max_len = self.max_model_len
        if isinstance(tokens, _TextTokens) and tokens.over_chars is not None:
            limit = self.tokens.max_chars_per_token
            assert limit is not None
            raise ApiError(text_over_context_message(tokens.over_chars, max_len, max_len * limit), "input_text")
        if len(tokens) <= max_len:
            if not tokens:
                raise ApiError("The decoder prompt cannot be empty")
            return
        count = min(len(tokens), max_len + 1) if text_prompt else len(tokens)
        raise ApiError(prompt_over_context_message(count, max_len), "input_tokens")

    def _prompts(self, prompt: Any) -> list[list[str]]:
        """The prompts of a completion request, as vLLM's ``CompletionRequest.prompt``
        takes them: a string, a list of strings, a list of token ids, or a list of lists of
        token ids (one prompt each). Token ids keep their identity as words (``"17"``), so
        prefix caching still sees equal prefixes."""
        if prompt is None or prompt == "":
            raise validation_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str):
            return [self._text(prompt)]
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
            return [self._text(x) for x in prompt]
        if all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in prompt):
            return [[str(t) for t in x] for x in prompt]
        raise ApiError("prompt must be a string, a list of strings, a list of token ids (>= 0), "
                       "or a list of lists of token ids", "prompt")
