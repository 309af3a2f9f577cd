"""Validation of incoming OpenAI requests, just enough to route them.

The body is forwarded to the replica byte for byte; the balancer only reads what it needs
(the prompt for prefix hashing, the model, max_tokens, stream, user) and rejects what a
replica would reject anyway, so bad input never costs a replica slot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from skymesh.balancer.errors import RequestError
from skymesh.tokens import chat_prompt

MAX_TOKENS_LIMIT = 1 << 20


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completions" | "chat"
    prompt: str
    model: str
    max_tokens: int
    stream: bool
    user: str | None


def parse_body(raw: bytes, kind: str, model: str) -> ParsedRequest:
    try:
        body: Any = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    m = body.get("model")
    if m is None:
        raise RequestError(400, "missing required field 'model'", "model")
    if not isinstance(m, str):
        raise RequestError(400, "'model' must be a string", "model")
    if m != model:
        raise RequestError(404, f"The model `{m}` does not exist.", "model")
    if kind == "chat":
        msgs = body.get("messages")
        if msgs is None:
            raise RequestError(400, "missing required field 'messages'", "messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError(400, "'messages' must be a non-empty list", "messages")
        for i, msg in enumerate(msgs):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise RequestError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
            c = msg.get("content")
            if c is not None and not isinstance(c, (str, list)):
                raise RequestError(400, f"messages[{i}].content must be a string or a list", "messages")
        prompt = chat_prompt(msgs)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        p = body.get("prompt")
        if p is None:
            raise RequestError(400, "missing required field 'prompt'", "prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if not isinstance(p, str):
            raise RequestError(400, "'prompt' must be a string (or a list of one string)", "prompt")
        prompt = p
        mt = body.get("max_tokens")
    if mt is None:
        mt = 16
    if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= MAX_TOKENS_LIMIT:
        raise RequestError(400, "'max_tokens' must be a positive integer", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", "stream")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(400, "'user' must be a string", "user")
    return ParsedRequest(kind=kind, prompt=prompt, model=m, max_tokens=mt, stream=stream, user=user)
