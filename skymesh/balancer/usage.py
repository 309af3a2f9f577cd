"""The replica's own word on a request's prefix-cache hit, read from the answer's tail.

vLLM started with ``--enable-prompt-tokens-details`` reports, in the answer's ``usage``
(non-streaming, or the last event of a stream whose client asked for
``stream_options.include_usage``), ``prompt_tokens_details.cached_tokens``: the prompt
tokens it found in its local prefix cache when it first scheduled the request. 0.32 writes
the field whenever the flag is on, 0 included (``is not None``; versions before omitted a
0, which would bias the count, so a usage without the field is not counted at all). For a
batch of prompts it is one prompt's count, so the balancer judges single prompts only.

The balancer compares it with what the policy expected (``Decision.matched_tokens``) to
count how well its picture of the caches predicts them (``skymesh_cache_predictions_total``,
judged by :mod:`skymesh.cache_prediction`).
The answer is proxied byte for byte, never parsed: this reads only its last few KiB, where
``usage`` is (after ``choices`` in every OpenAI-shaped answer vLLM writes).
"""

from __future__ import annotations

import re

# the tail kept of every answer: usage is a few hundred bytes followed by "data: [DONE]"
TAIL_BYTES = 4096

# an unescaped quote opens a JSON key; inside a JSON string every quote is preceded by a
# backslash, so generated text cannot fake these
_USAGE_KEY = b'"usage"'
_BACKSLASH = 0x5C
# what follows the key of a usage object (or of a usage the answer left null)
_AFTER_USAGE_KEY = re.compile(rb'\s*:\s*(null|\{)')
_CACHED = re.compile(rb'(?<!\\)"cached_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'(?<!\\)"completion_tokens"\s*:\s*(\d+)')


def reported_cached_tokens(tail: bytes) -> int | None:
    """Cached prompt tokens reported in the answer ending with ``tail``; None when the tail
    holds no ``usage`` object with the field (the client did not ask for usage, the replica
    does not report it, or the answer is cut)."""
    return _usage_field(tail, _CACHED)


def reported_completion_tokens(tail: bytes) -> int | None:
    """Output tokens reported in the answer's usage (judging an SLO class's TPOT); None
    when the tail holds no usage with them."""
    return _usage_field(tail, _COMPLETION)


def _last_usage(tail: bytes) -> re.Match[bytes] | None:
    """The last ``"usage": null`` or ``"usage": {`` in ``tail`` whose key is unescaped (what
    follows the key, as a match; None: none). Searched from the end (``rfind``, in C): the
    tail of every answer is scanned, and most hold no usage at all."""
    end = len(tail)
    while (at := tail.rfind(_USAGE_KEY, 0, end)) >= 0:
        if at == 0 or tail[at - 1] != _BACKSLASH:
            after = _AFTER_USAGE_KEY.match(tail, at + len(_USAGE_KEY))
            if after is not None:
                return after
        end = at
    return None


def _usage_field(tail: bytes, field: re.Pattern[bytes]) -> int | None:
    last = _last_usage(tail)
    if last is None or last.group(1) == b"null":
        return None
    found = field.search(tail, last.end())
    return int(found.group(1)) if found is not None else None

