"""Validation of incoming OpenAI requests, just enough to route them.

The body is forwarded to the replica byte for byte; the balancer only reads what it needs
(the prompt for prefix hashing, the model, max_tokens, stream, user) and rejects what a
replica would reject anyway, so bad input never costs a replica slot and never becomes a
5xx. Every way the body can be unreadable is a 400 in OpenAI's error shape:

* not UTF-8 (RFC 8259 JSON is UTF-8; a UTF-16/32 body is refused rather than sniffed),
  or not JSON;
* nested deeper than the json module can parse (its ``RecursionError``);
* an integer over Python's int/str conversion limit (4,300 digits: ``ValueError``);
* ``NaN``/``Infinity``/``-Infinity`` tokens or a float literal that overflows to
  infinity: not JSON numbers (RFC 8259), and nothing a replica can use;
* a lone UTF-16 surrogate (``"\\ud800"`` without its pair) in *any* string, key or
  value: ``json`` accepts the escape, but no such string can be encoded as UTF-8, so
  hashing the prompt (or the replica's tokenizer) would fail on it. Rejecting beats
  replacing: the body is forwarded byte for byte, so a replacement here would not be the
  text the replica sees.
* a field the balancer reads with the wrong type or range, or chat content it cannot
  flatten (:func:`skymesh.word_tokenizer.chat_prompt`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from skymesh.edge.openai_errors import RequestError
from skymesh.word_tokenizer import ChatContentError, chat_prompt

MAX_TOKENS_LIMIT = 1 << 20
# vLLM's default for /v1/completions; a chat request without a limit runs to the end of
# the context (max_tokens None here: the balancer assumes upstream.unbounded_chat_max_tokens)
DEFAULT_MAX_TOKENS = 16

# a \uD800-\uDFFF escape in the raw bytes: only then can the parsed body hold a lone
# surrogate, so only then is the (whole-body) check paid for
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


# a token id must fit vLLM's (unsigned 32-bit) vocabulary index; the replica checks it
# against the real vocabulary size
MAX_TOKEN_ID = (1 << 32) - 1


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completions" | "chat"
    # the text routed on: a completion's (first) prompt, or a chat flattened
    # (skymesh.word_tokenizer.chat_prompt); "" for a token-id prompt
    prompt: str
    model: str
    max_tokens: int | None  # None: a chat request without a limit (the replica decides)
    stream: bool
    user: str | None
    # a token-id prompt (vLLM accepts ``prompt`` as a list of ints): routed by its ids
    prompt_ids: list[int] | None = None
    # chat: the messages as sent (a configured chat template renders them)
    messages: list[Any] | None = None
    # completions: how many prompts the request carries (a batch is one request to one
    # replica); the prompts after the first count for load only
    batch_size: int = 1
    # the characters (or ids) of the prompts after the first, for the token estimate
    extra_prompts: list[str | list[int]] | None = None
    # the field the output budget came from (vLLM names it in its refusals)
    budget_param: str = "max_tokens"


class _NonFiniteNumber(ValueError):
    pass


def _reject_constant(token: str) -> NoReturn:
    raise _NonFiniteNumber(token)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise _NonFiniteNumber(literal)
    return value


def _bad(message: str, param: str | None = None) -> NoReturn:
    raise RequestError(400, message, param=param)


@functools.cache
def _decoder() -> json.JSONDecoder:
    """The one decoder of request bodies: ``json.loads`` with these hooks would build a
    new one for every request."""
    return json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def load_json_body(raw: bytes) -> Any:
    """The parsed body, or a 400 :class:`RequestError` saying why it cannot be read."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _bad(f"request body is not valid UTF-8: {e}")
    try:
        if text.startswith("\ufeff"):  # as json.loads says it (the decoder alone would not)
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        body = _decoder().decode(text)
    except json.JSONDecodeError as e:
        _bad(f"request body is not valid JSON: {e}")
    except _NonFiniteNumber as e:
        _bad(f"request body holds a number that is not finite ({e}): JSON numbers are finite")
    except RecursionError:
        _bad("request body is nested too deeply")
    except ValueError as e:  # int() past sys.get_int_max_str_digits()
        _bad(f"request body holds a number with too many digits: {e}")
    if _SURROGATE_ESCAPE.search(raw) is not None:
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            _bad("request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair)")
    return body


def _token_limit(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        _bad(f"'{field}' must be an integer between 1 and {MAX_TOKENS_LIMIT}", field)
    return value


def parse_body(raw: bytes, kind: str, model: str) -> ParsedRequest:
    body = load_json_body(raw)
    if not isinstance(body, dict):
        _bad("request body must be a JSON object")
    m = body.get("model")
    if m is None:
        _bad("missing required field 'model'", "model")
    if not isinstance(m, str):
        _bad("'model' must be a string", "model")
    if m != model:
        raise RequestError(404, f"The model `{m}` does not exist.", param="model")
    if kind == "chat":
        msgs = body.get("messages")
        if msgs is None:
            _bad("missing required field 'messages'", "messages")
        if not isinstance(msgs, list) or not msgs:
            _bad("'messages' must be a non-empty list", "messages")
        try:
            prompt = chat_prompt(msgs)
        except ChatContentError as e:
            _bad(str(e), e.param)
        # vLLM reads max_completion_tokens first and max_tokens when it is null; both are
        # validated, as vLLM validates both
        completion_limit = _token_limit(body, "max_completion_tokens")
        legacy_limit = _token_limit(body, "max_tokens")
        limit = completion_limit if completion_limit is not None else legacy_limit
    else:
        prompts = _completion_prompts(body.get("prompt"))
        first = prompts[0]
        prompt = first if isinstance(first, str) else ""
        prompt_ids = None if isinstance(first, str) else first
        batch = len(prompts)
        extra = prompts[1:] or None
        limit = _token_limit(body, "max_tokens")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        _bad("'stream' must be a boolean", "stream")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        _bad("'user' must be a string", "user")
    if kind == "chat":
        return ParsedRequest(kind=kind, prompt=prompt, model=m, max_tokens=limit,
                             stream=bool(stream), user=user, messages=msgs,
                             budget_param="max_completion_tokens" if completion_limit is not None else "max_tokens")
    return ParsedRequest(kind=kind, prompt=prompt, model=m,
                         max_tokens=DEFAULT_MAX_TOKENS if limit is None else limit,
                         stream=bool(stream), user=user, prompt_ids=prompt_ids, batch_size=batch,
                         extra_prompts=extra)


def _token_ids(value: list[Any], where: str) -> list[int]:
    if not value:
        _bad(f"{where} must not be empty", "prompt")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            _bad(f"{where}[{i}] must be a token id (an integer 0-{MAX_TOKEN_ID})", "prompt")
    return value


def _completion_prompts(p: Any) -> list[str | list[int]]:
    """The prompts of a completions request, as vLLM accepts them: a string, a list of
    strings, a list of token ids, or a list of lists of token ids."""
    if p is None:
        _bad("missing required field 'prompt'", "prompt")
    if isinstance(p, str):
        return [p]
    if not isinstance(p, list) or not p:
        _bad("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids",
             "prompt")
    if all(isinstance(x, str) for x in p):
        return list(p)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [_token_ids(p, "prompt")]
    if all(isinstance(x, list) for x in p):
        return [_token_ids(x, f"prompt[{i}]") for i, x in enumerate(p)]
    _bad("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids",
         "prompt")
