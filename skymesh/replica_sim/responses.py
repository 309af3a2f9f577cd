"""The stand-in's answers to a generation request, shaped as vLLM 0.32 writes them: the
JSON body or the SSE stream built from the engine loop's events for the request (with
vLLM's per-request latency metrics recorded on the way), ``usage`` and its
``prompt_tokens_details``, and vLLM's error body."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from skymesh.replica_sim.engine_loop import Event
from skymesh.replica_sim.request_parsing import GenRequest
from skymesh.replica_sim.request_state import EngineRequest
from skymesh.replica_sim.vllm_metrics import ReplicaMetrics
from skymesh.word_tokenizer import filler_tokens

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def vllm_error(status: int, message: str, param: str | None = None) -> web.Response:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _ERROR_TYPES.get(status, "InternalServerError")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


def _dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


class ResponseWriter:
    """Writes the answers of one server (its model name, metrics and block size)."""

    def __init__(self, model: str, metrics: ReplicaMetrics, block_size: int,
                 enable_prompt_tokens_details: bool) -> None:
        self.model = model
        self.metrics = metrics
        self.block_size = block_size
        # vLLM's --enable-prompt-tokens-details: usage reports the prompt tokens found in
        # the prefix cache
        self.enable_prompt_tokens_details = enable_prompt_tokens_details

    async def respond(self, request: web.Request, rid: str, chat: bool, g: GenRequest,
                      queue: asyncio.Queue[Event], ereqs: list[EngineRequest],
                      arrival: float) -> web.StreamResponse:
        """Answer request ``rid`` from the events its engine requests ``ereqs`` put on
        ``queue``: a stream as the tokens come, or the whole body once every prompt is done."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": self.model}
        resp: web.StreamResponse | None = None
        if g.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
        count = len(g.prompts)
        produced = [0] * count
        first_at = [arrival] * count
        last_at = [arrival] * count
        open_prompts = count
        while open_prompts:
            kind, n, t, i = await queue.get()
            if kind == "error":
                if resp is None:
                    return vllm_error(500, "engine failure")
                await resp.write(b"data: " + _dumps({"error": {"message": "engine failure",
                                                              "type": "InternalServerError",
                                                              "param": None, "code": 500}}) + b"\n\n")
                return resp
            if kind == "finished":
                open_prompts -= 1
                end = last_at[i]
                e = ereqs[i]
                scheduled = e.first_scheduled_at if e.first_scheduled_at is not None else arrival
                self.metrics.finished("length", end - arrival, max(0.0, scheduled - arrival),
                                      max(0.0, first_at[i] - scheduled), end - first_at[i],
                                      len(g.prompts[i]), produced[i])
                continue
            if produced[i] == 0:
                first_at[i] = t
                self.metrics.ttft.observe(t - arrival)
            else:
                self.metrics.itl.observe(t - last_at[i])
            last_at[i] = t
            start = produced[i]
            produced[i] += n
            if resp is not None:
                if chat and start == 0:
                    # vLLM opens a chat stream with the role and empty content
                    await self._sse(resp, {**head, "choices": [{
                        "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]})
                text = "".join(" " + w for w in filler_tokens(n, start))
                reason = "length" if produced[i] >= g.max_tokens[i] else None
                choice: dict[str, Any] = (
                    {"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
                    if chat else
                    {"index": i, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
                )
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
        texts = ["".join(" " + w for w in filler_tokens(k)) for k in produced]
        if chat:
            choices: list[dict[str, Any]] = [{
                "index": 0, "message": {"role": "assistant", "content": texts[0], "tool_calls": []},
                "logprobs": None, "finish_reason": "length", "stop_reason": None}]
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": "length",
                        "stop_reason": None, "prompt_logprobs": None} for i, text in enumerate(texts)]
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": self.model, "choices": choices,
                                  "usage": usage})

    def _prompt_tokens_details(self, chat: bool, stream: bool, g: GenRequest,
                               ereqs: list[EngineRequest]) -> dict[str, Any] | None:
        """usage.prompt_tokens_details as vLLM 0.32 writes it with the flag on: a batch's
        stream reports its first prompt, its whole answer the last one; a completion
        stream's chunk leaves out the fields never set; a chat also counts the prompt
        tokens it wrote to the cache (its full blocks not found there)."""
        if not self.enable_prompt_tokens_details:
            return None
        e = ereqs[0] if stream else ereqs[-1]
        if chat:
            written = len(g.prompts[0]) // self.block_size * self.block_size - e.cached_tokens
            return {"cached_tokens": e.cached_tokens, "created_cache_tokens": max(0, written),
                    "multimodal_tokens": None}
        if stream:
            return {"cached_tokens": e.cached_tokens}
        return {"cached_tokens": e.cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}

    @staticmethod
    async def _sse(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + _dumps(payload) + b"\n\n")
