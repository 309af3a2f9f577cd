"""What the balancer routes on: a prompt's token count and its chunk hashes, token-true.

With the model's ``tokenizer.json`` configured (``tokenizer.path``, read from disk with
HF ``tokenizers``, never fetched), a prompt is encoded to token ids as the replica will
encode it, and ``chunk_hashes[i]`` is the cumulative xxhash64 of token-id chunks 0..i of
``policy.chunk_tokens`` ids each, so chunks line up with the replica's KV blocks when
``chunk_tokens`` is the block size (or a multiple of it). Chat requests go through the
model's chat template (``tokenizer.chat_template``, rendered by a sandboxed jinja2 as
vLLM renders it) when one is configured; otherwise through skymesh's own flattening
(:func:`skymesh.word_tokenizer.chat_prompt`), which is stable but not what the replica sees.

Without a tokenizer, a language-agnostic fallback over UTF-8 bytes: chunks of
``chunk_tokens * bytes_per_token`` bytes, and tokens estimated as bytes /
``bytes_per_token`` (4 by default: ~4 bytes per BPE token for English; CJK text runs at
~1-1.5 characters of 3 bytes each per token, so the estimate is within ~2x there). A
prompt that differs only in whitespace is a different prefix, as it is for the replica;
Japanese or Chinese text without spaces shares prefixes chunk by chunk like any other.

Token-id prompts (a list of ints) are hashed as ids in both modes, so with a tokenizer
they share prefixes with the same text sent as a string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skymesh.routing.hashing import byte_chunk_hashes, id_chunk_hashes

__all__ = ["EncodedPrompt", "PromptEncoder", "byte_chunk_hashes", "id_chunk_hashes"]

# encoding a prompt longer than this (characters) runs in a worker thread: a 32k-token
# prompt takes tens of milliseconds to encode, which the event loop must not stall for
# (the tokenizer's batch call releases the GIL, so the loop keeps running meanwhile)
OFF_LOOP_CHARS = 4096


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    chunk_hashes: tuple[int, ...]
    tokens: int


class ChatTemplate:
    """A model's chat template (jinja2, sandboxed as transformers and vLLM run it)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.bos_token, eos_token=self.eos_token)


class ChatTemplateError(ValueError):
    """The template refused the conversation (its own ``raise_exception``): a 400."""


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(message)


class PromptEncoder:
    """Prompt -> :class:`EncodedPrompt`, by a tokenizer when one is given, else by bytes."""

    def __init__(self, chunk_tokens: int, tokenizer: Any | None = None, chat_template: ChatTemplate | None = None,
                 bytes_per_token: float = 4.0) -> None:
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")
        self.chunk_tokens = chunk_tokens
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bytes_per_token = bytes_per_token
        self.mode = "tokenizer" if tokenizer is not None else "bytes"

    @classmethod
    def from_files(cls, chunk_tokens: int, tokenizer_path: str | Path | None = None,
                   chat_template_path: str | Path | None = None, bytes_per_token: float = 4.0) -> PromptEncoder:
        tok = None
        template = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tokenizer_path))
        if chat_template_path is not None:
            source = Path(chat_template_path).read_text(encoding="utf-8")
            bos, eos = _special_tokens(tokenizer_path)
            template = ChatTemplate(source, bos, eos)
        return cls(chunk_tokens, tok, template, bytes_per_token)

    # ------------------------------------------------------------------ text

    def encode_text(self, text: str, *, chat: bool = False) -> EncodedPrompt:
        if self.tokenizer is not None:
            # a rendered chat template carries its own special tokens (BOS included), as
            # vLLM encodes it; a completion prompt gets the tokenizer's (BOS) added
            # encode_batch, not encode: only the batch call releases the GIL (measured:
            # two threads encode 1.7x as fast with it, 1.0x with encode)
            ids = self.tokenizer.encode_batch([text], add_special_tokens=not chat)[0].ids
            return EncodedPrompt(id_chunk_hashes(ids, self.chunk_tokens), len(ids))
        data = text.encode("utf-8")
        chunk_bytes = max(1, round(self.chunk_tokens * self.bytes_per_token))
        tokens = -(-len(data) // max(1, round(self.bytes_per_token))) if data else 0
        return EncodedPrompt(byte_chunk_hashes(data, chunk_bytes), tokens)

    def encode_ids(self, ids: Sequence[int]) -> EncodedPrompt:
        return EncodedPrompt(id_chunk_hashes(ids, self.chunk_tokens), len(ids))


def _special_tokens(tokenizer_path: str | Path | None) -> tuple[str, str]:
    """BOS/EOS strings for a chat template, from tokenizer_config.json beside the
    tokenizer when it exists (where HF keeps them); empty otherwise."""
    if tokenizer_path is None:
        return "", ""
    cfg_path = Path(tokenizer_path).with_name("tokenizer_config.json")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "", ""

    def text(v: Any) -> str:
        if isinstance(v, dict):
            v = v.get("content", "")
        return v if isinstance(v, str) else ""

    return text(cfg.get("bos_token")), text(cfg.get("eos_token"))
