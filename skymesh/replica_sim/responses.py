"""The stand-in's answers to a generation request, shaped as vLLM 0.32 writes them: the
JSON body or the SSE stream built from the engine loop's events for the request (with
vLLM's per-request latency metrics recorded on the way), its ``n`` choices per prompt,
``echo``, ``logprobs`` (logprobs.py), ``usage`` and its ``prompt_tokens_details``, and
vLLM's error body."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from skymesh.replica_sim.engine_loop import Event
from skymesh.replica_sim.logprobs import LogprobsWriter, Position
from skymesh.replica_sim.request_parsing import GenRequest
from skymesh.replica_sim.request_state import EngineRequest
from skymesh.replica_sim.tokenization import StandInTokenizer
from skymesh.replica_sim.vllm_metrics import ReplicaMetrics

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def vllm_error(status: int, message: str, param: str | None = None, kind: str | None = None) -> web.Response:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = kind or _ERROR_TYPES.get(status, "InternalServerError")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


async def generation_error(request: web.Request, stream: bool) -> web.StreamResponse:
    """vLLM's answer to a request that finished with ``finish_reason == "error"`` (a failed
    KV load under ``kv_load_failure_policy: fail``): a ``GenerationError``, HTTP 500 when
    not streamed; streamed, the 200 stream carries the error event, then ``[DONE]``."""
    if not stream:
        return vllm_error(500, "Internal server error")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(b"data: " + json.dumps({"error": {"message": "Internal server error",
                                                       "type": "InternalServerError", "param": None,
                                                       "code": 500}}).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


class ResponseWriter:
    """Writes the answers of one server (its model name, metrics, block size and tokens)."""

    def __init__(self, model: str, metrics: ReplicaMetrics, block_size: int,
                 enable_prompt_tokens_details: bool, tokens: StandInTokenizer | None = None) -> None:
        self.model = model
        self.metrics = metrics
        self.block_size = block_size
        # vLLM's --enable-prompt-tokens-details: usage reports the prompt tokens found in
        # the prefix cache
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tokens = tokens if tokens is not None else StandInTokenizer()
        self.logprobs = LogprobsWriter(self.tokens)

    def _generated(self, start: int, n: int) -> list[Position]:
        """Generated tokens ``start`` .. ``start + n - 1`` as logprobs positions."""
        strings = self.tokens.generated_strings(start, n)
        return [Position(text, self._generated_token(start + k)) for k, text in enumerate(strings)]

    def _generated_token(self, position: int) -> str:
        token_id = self.tokens.generated_id(position)
        return f"tok{position}" if token_id is None else str(token_id)

    def _prompt(self, tokens: list[str]) -> list[Position]:
        """A prompt's tokens as logprobs positions (the first has none, as in vLLM)."""
        return [Position(self.tokens.token_string(t), t, scored=k > 0) for k, t in enumerate(tokens)]

    async def respond(self, request: web.Request, rid: str, chat: bool, g: GenRequest,
                      queue: asyncio.Queue[Event], ereqs: list[EngineRequest],
                      arrival: float, kv_params: Callable[[], dict[str, Any] | None] | None = None
                      ) -> web.StreamResponse:
        """Answer request ``rid`` from the events its engine requests ``ereqs`` put on
        ``queue``: a stream as the tokens come, or the whole body once every prompt is done.
        Engine request (and choice) ``s`` is choice ``s % g.n`` of prompt ``s // g.n``,
        with the choice ``index`` ``s``, as vLLM numbers a batch's choices. ``kv_params``:
        the connector's ``kv_transfer_params`` for the whole body (a prefill leg's), taken
        once every prompt is done; vLLM's stream chunks have no such field."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": self.model}
        resp: web.StreamResponse | None = None
        if g.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
        count = len(g.prompts) * g.n
        produced = [0] * count
        first_at = [arrival] * count
        last_at = [arrival] * count
        # a streamed completion choice's logprobs text_offset so far (echo included)
        text_offsets = [0] * count
        opened = False  # a chat stream's opening chunks sent
        open_slots = count
        while open_slots:
            kind, n, t, i = await queue.get()
            p = i // g.n
            if kind == "error":
                if resp is None:
                    return vllm_error(500, "engine failure")
                await resp.write(b"data: " + _dumps({"error": {"message": "engine failure",
                                                              "type": "InternalServerError",
                                                              "param": None, "code": 500}}) + b"\n\n")
                return resp
            if kind == "finished":
                open_slots -= 1
                end = last_at[i]
                e = ereqs[i]
                scheduled = e.first_scheduled_at if e.first_scheduled_at is not None else arrival
                self.metrics.finished("length", end - arrival, max(0.0, scheduled - arrival),
                                      max(0.0, first_at[i] - scheduled), end - first_at[i],
                                      len(g.prompts[p]), produced[i])
                continue
            if produced[i] == 0:
                first_at[i] = t
                self.metrics.ttft.observe(t - arrival)
            else:
                self.metrics.itl.observe(t - last_at[i])
            last_at[i] = t
            start = produced[i]
            produced[i] += n
            if resp is None:
                continue
            if chat and not opened:
                opened = True
                await self._open_chat_stream(resp, head, g)
            reason = "length" if produced[i] >= g.max_tokens[p] else None
            generated = [] if g.echo_only else self._generated(start, n)
            if chat:
                choice: dict[str, Any] = {
                    "index": i, "delta": {"content": "".join(x.text for x in generated)},
                    "logprobs": None if g.logprobs is None else self.logprobs.chat(generated, g.logprobs),
                    "finish_reason": reason}
                if reason is not None:  # vLLM sets it on a choice's last chunk only
                    choice["stop_reason"] = None
            else:
                text = "".join(x.text for x in generated)
                if g.echo and start == 0:  # the first chunk carries the prompt (vLLM's has_echoed)
                    text = g.prompt_texts[p] + text
                    generated = self._prompt(g.prompts[p]) + generated
                logprobs = None
                if g.logprobs is not None:
                    logprobs = self.logprobs.completion(generated, g.logprobs, text_offsets[i])
                    text_offsets[i] += sum(len(x.text) for x in generated)
                choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason,
                          "stop_reason": None}
            await self._sse(resp, {**head, "choices": [choice]})
        n_prompt = sum(len(p) for p in g.prompts)
        n_out = sum(produced)
        usage: dict[str, Any] = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out,
                                 "completion_tokens": n_out}
        details = self._prompt_tokens_details(chat, resp is not None, g, ereqs)
        # vLLM serializes a stream's chunks without unset fields: a completion's usage
        # chunk sets prompt_tokens_details only with the flag, a chat's always
        if details is not None or chat or resp is None:
            usage["prompt_tokens_details"] = details
        if resp is not None:
            if g.include_usage:
                await self._sse(resp, {**head, "choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        body: dict[str, Any] = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                "created": created, "model": self.model,
                                "choices": self._chat_choices(g, produced) if chat else
                                self._completion_choices(g, produced), "usage": usage}
        if chat:  # vLLM computes them for a chat's echo
            body["prompt_logprobs"] = None if g.prompt_logprobs is None else self.logprobs.prompt_logprobs(
                self._prompt(g.prompts[0]), g.prompt_logprobs)
        # vLLM's responses always carry the field: null without a connector (or one that
        # returns none, as an aborted prefill leg's)
        body["kv_transfer_params"] = kv_params() if kv_params is not None else None
        return web.json_response(body)

    async def _open_chat_stream(self, resp: web.StreamResponse, head: dict[str, Any], g: GenRequest) -> None:
        """vLLM opens a chat stream with one chunk per choice holding the role and empty
        content, then, with echo, one per choice holding the echoed content."""
        for j in range(g.n):
            await self._sse(resp, {**head, "choices": [{
                "index": j, "delta": {"role": g.role, "content": ""}, "logprobs": None, "finish_reason": None}]})
        if g.chat_echo:
            for j in range(g.n):
                await self._sse(resp, {**head, "choices": [{
                    "index": j, "delta": {"content": g.chat_echo}, "logprobs": None, "finish_reason": None}]})

    def _completion_choices(self, g: GenRequest, produced: list[int]) -> list[dict[str, Any]]:
        choices = []
        for i, k in enumerate(produced):
            p = i // g.n
            positions = [] if g.echo_only else self._generated(0, k)
            text = "".join(x.text for x in positions)
            prompt_logprobs = None
            if g.echo:
                prompt = self._prompt(g.prompts[p])
                text = g.prompt_texts[p] + text
                positions = prompt + positions
                if g.prompt_logprobs is not None:
                    prompt_logprobs = self.logprobs.prompt_logprobs(prompt, g.prompt_logprobs)
            choices.append({"index": i, "text": text, "finish_reason": "length", "stop_reason": None,
                            "logprobs": None if g.logprobs is None else self.logprobs.completion(positions, g.logprobs),
                            "prompt_logprobs": prompt_logprobs})
        return choices

    def _chat_choices(self, g: GenRequest, produced: list[int]) -> list[dict[str, Any]]:
        choices = []
        for i, k in enumerate(produced):
            positions = self._generated(0, k)
            choices.append({
                "index": i,
                # vLLM leaves an empty tool_calls out of the message
                "message": {"role": g.role, "content": g.chat_echo + "".join(x.text for x in positions)},
                "logprobs": None if g.logprobs is None else self.logprobs.chat(positions, g.logprobs),
                "finish_reason": "length", "stop_reason": None})
        return choices

    def _prompt_tokens_details(self, chat: bool, stream: bool, g: GenRequest,
                               ereqs: list[EngineRequest]) -> dict[str, Any] | None:
        """usage.prompt_tokens_details as vLLM 0.32 writes it with the flag on: a batch's
        stream reports its first prompt, its whole answer the last one; a completion
        stream's chunk leaves out the fields never set; a chat also counts the prompt
        tokens it wrote to the cache (its full blocks not found there)."""
        if not self.enable_prompt_tokens_details:
            return None
        # a batch's first prompt when streamed, its last otherwise (each prompt's first choice)
        e = ereqs[0] if stream else ereqs[(len(g.prompts) - 1) * g.n]
        # a decode leg reports the prefill replica's hits (vLLM's output_processor.py)
        cached = e.cached_tokens if g.remote_prefill_cached_tokens is None else g.remote_prefill_cached_tokens
        if chat:
            written = len(g.prompts[0]) // self.block_size * self.block_size - cached
            return {"cached_tokens": cached, "created_cache_tokens": max(0, written),
                    "multimodal_tokens": None}
        if stream:
            return {"cached_tokens": cached}
        return {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}

    @staticmethod
    async def _sse(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + _dumps(payload) + b"\n\n")
