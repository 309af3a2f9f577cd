"""The deterministic tokenizer contract shared by the stand-in replica, the balancer and
the benchmark harness.

* A token is a whitespace-separated word: ``count_tokens(text) == len(text.split())``.
* A chat request is flattened to one prompt: for each message ``<|role|>`` followed by
  its content words, in order (so ``<|system|> You are ...`` shares a prefix with every
  request carrying the same system prompt).
* The stand-in replica ends a chat prompt with ``GENERATION_PROMPT`` (``<|assistant|>``),
  as vLLM's chat templates do with ``add_generation_prompt``, and its answer follows: a
  next turn carrying that answer flattens to this turn's prompt plus the answer, so it
  shares their prefix. The balancer hashes ``chat_prompt`` alone, a prefix of it.
* Trace replay: hash id ``h`` of a Mooncake trace (a 512-token block) becomes
  ``block_text(h)``: 512 words that are unique to ``h``; equal ids give equal text, so
  requests whose ``hash_ids`` share a prefix get prompts sharing that text prefix.

The balancer does not count or hash prompts this way: it uses the model's tokenizer, or
UTF-8 byte chunks without one (skymesh/prompt_encoder.py), since whitespace words make a
Japanese or Chinese prompt one "token". This module is the stand-in's and the trace
replay's word model, and the chat flattening both sides share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

TRACE_BLOCK_TOKENS = 512
GENERATION_PROMPT = "<|assistant|>"


def split_tokens(text: str) -> list[str]:
    return text.split()


def count_tokens(text: str) -> int:
    return len(text.split())


class ChatContentError(ValueError):
    """A chat message the flattening cannot read; ``param`` names the offending field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


# The content-part types vLLM's OpenAI chat API parses (vllm/entrypoints/chat_utils.py)
# and the field each one carries its payload in. Only "text" parts reach the prompt the
# balancer hashes: the others are forwarded as they are and left to the replica (a
# text-only model answers them with its own 400).
CONTENT_PART_FIELDS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "refusal": "refusal",
    "image_url": "image_url",
    "image_embeds": "image_embeds",
    "input_image": "image_url",
    "input_audio": "input_audio",
    "audio_url": "audio_url",
    "video_url": "video_url",
}
_TEXT_PART_TYPES = frozenset({"text", "input_text"})


def _content_text(content: Any, index: int) -> str:
    """The text of one message's content: a string, or the text of its content parts.

    vLLM accepts a part given as a bare string too, so that counts as text here.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatContentError(f"messages[{index}].content must be a string, a list of content parts or null")
    texts: list[str] = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatContentError(f"{where} must be an object with a 'type'")
        part_type = part.get("type")
        if not isinstance(part_type, str):
            raise ChatContentError(f"{where}.type must be a string")
        field = CONTENT_PART_FIELDS.get(part_type)
        if field is None:
            known = ", ".join(sorted(CONTENT_PART_FIELDS))
            raise ChatContentError(f"{where}.type '{part_type}' is not a supported content part type ({known})")
        if field not in part:
            raise ChatContentError(f"{where} of type '{part_type}' needs a '{field}' field")
        if part_type in _TEXT_PART_TYPES:
            text = part[field]
            if not isinstance(text, str):
                raise ChatContentError(f"{where}.text must be a string")
            texts.append(text)
    return " ".join(texts)


def chat_prompt(messages: Sequence[Any]) -> str:
    """Flatten OpenAI chat messages into one prompt string.

    Raises :class:`ChatContentError` for a message that is not an object with a string
    ``role``, or whose content is neither a string, null nor a list of content parts
    (``CONTENT_PART_FIELDS``) whose text parts carry a string ``text``.
    """
    parts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatContentError(f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise ChatContentError(f"messages[{i}].role must be a string")
        parts.append(f"<|{role}|>")
        parts.append(_content_text(m.get("content"), i))
    return " ".join(p for p in parts if p)


def block_text(hash_id: int, n_tokens: int = TRACE_BLOCK_TOKENS) -> str:
    """``n_tokens`` words unique to ``hash_id`` (deterministic, no randomness)."""
    return " ".join(f"b{hash_id}w{i}" for i in range(n_tokens))


def trace_prompt(hash_ids: Iterable[int], input_length: int) -> str:
    """Prompt of exactly ``input_length`` tokens whose blocks are ``block_text(hash_id)``.

    The last block of a trace request is usually partial: it is cut to length.
    """
    words: list[str] = []
    for h in hash_ids:
        if len(words) >= input_length:
            break
        words.extend(f"b{h}w{i}" for i in range(TRACE_BLOCK_TOKENS))
    if len(words) < input_length:  # trace lengths beyond its blocks: pad deterministically
        words.extend(f"pad{i}" for i in range(input_length - len(words)))
    return " ".join(words[:input_length])


def word_token_id(word: str) -> int:
    """The token id the stand-in reports for one of its tokens (KV events' ``token_ids``):
    a token that is a token id already (a token-id prompt, or a tokenizer's output, both
    kept as decimal strings) is that id; any other word gets a deterministic id above
    2**32, out of reach of real vocabularies, so it never poses as a real token."""
    if word.isdecimal() and word.isascii() and (len(word) == 1 or word[0] != "0"):
        return int(word) & 0xFFFFFFFFFFFFFFFF
    return (1 << 32) | xxhash.xxh32_intdigest(word.encode())


def filler_tokens(n: int, start: int = 0) -> list[str]:
    """Generated text: filler words ("tok0 tok1 ..."), one per output token."""
    return [f"tok{i}" for i in range(start, start + n)]
