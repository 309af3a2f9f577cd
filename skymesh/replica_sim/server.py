"""The vLLM stand-in's HTTP server: vLLM's OpenAI API and Prometheus metrics over the
pure engine model. A balancer cannot tell it from vLLM for routing purposes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from skymesh.prom import Counter, Gauge, Histogram, Registry
from skymesh.replica_sim.engine import Engine, chained_block_hashes
from skymesh.replica_sim.profiles import PROFILES, Profile
from skymesh.tokens import chat_prompt, filler_tokens, split_tokens

log = logging.getLogger("skymesh.replica_sim")

# vLLM v1's histogram buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LABELS = ("engine", "model_name")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def vllm_error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


@dataclass
class _Stream:
    queue: asyncio.Queue[tuple[str, int]] = field(default_factory=asyncio.Queue)
    arrival: float = 0.0
    last_token_at: float = 0.0


class ReplicaServer:
    def __init__(self, profile: Profile, time_scale: float = 1.0, model: str = "skymesh-sim",
                 **engine_overrides: Any) -> None:
        self.profile = profile
        self.model = model
        self.engine = Engine(profile, time_scale=time_scale, **engine_overrides)
        self.streams: dict[str, _Stream] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.host = "127.0.0.1"
        lv = ("0", model)
        e = self.engine
        self.registry = r = Registry()

        def g(name: str, help_text: str, fn: Any) -> None:
            r.add(Gauge(name, help_text, LABELS, lambda: [(lv, float(fn()))]))

        def c(name: str, help_text: str, fn: Any) -> None:
            r.add(Gauge(name, help_text, LABELS, lambda: [(lv, float(fn()))]))
            r.metrics[-1].kind = "counter"

        g("vllm:num_requests_running", "Number of requests in model execution batches.", lambda: e.num_running)
        g("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda: e.num_waiting)
        g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda: e.kv_cache_usage)
        c("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
          lambda: e.prefix_cache_queries)
        c("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
          lambda: e.prefix_cache_hits)
        c("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
          lambda: e.num_preemptions)
        c("vllm:prompt_tokens_total", "Number of prefill tokens processed.", lambda: e.prompt_tokens_total)
        c("vllm:generation_tokens_total", "Number of generation tokens processed.",
          lambda: e.generation_tokens_total)
        self.success = Counter("vllm:request_success_total", "Count of successfully processed requests.",
                               (*LABELS, "finished_reason"))
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS, LABELS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             E2E_BUCKETS, LABELS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS, LABELS)
        for m in (self.success, self.ttft, self.e2e, self.itl):
            r.add(m)
        self._lv = lv

    # ------------------------------------------------------------------ engine loop

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_work():
                self._work.clear()
                await self._work.wait()
                continue
            out = self.engine.step(loop.time())
            if out.steps == 0:
                # nothing fits (a waiting request needs blocks held by none): wait for news
                self._work.clear()
                await self._work.wait()
                continue
            await asyncio.sleep(out.duration_s)
            now = loop.time()
            for rid, n in out.tokens:
                s = self.streams.get(rid)
                if s is not None:
                    s.queue.put_nowait(("tokens", n))
            for rid in out.finished:
                s = self.streams.get(rid)
                if s is not None:
                    s.queue.put_nowait(("finished", 0))
            del now

    # ------------------------------------------------------------------ HTTP

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._loop_task = asyncio.create_task(self._engine_loop())
        self._runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False,
                                     handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        self.host = host
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.registry.render(), content_type="text/plain", charset="utf-8")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.profile.max_model_len}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _parse(self, body: Any, chat: bool) -> tuple[str, int, bool, bool]:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        if body.get("model") != self.model:
            raise BadRequest(f"The model `{body.get('model')}` does not exist.", "model", 404)
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs
            ):
                raise BadRequest("'messages' must be a non-empty list of {role, content}", "messages")
            prompt = chat_prompt(msgs)
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise BadRequest("'prompt' must be a string", "prompt")
            mt = body.get("max_tokens")
        mt = 16 if mt is None else mt
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise BadRequest("max_tokens must be at least 1", "max_tokens")
        min_tokens = body.get("min_tokens", 0)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0 or min_tokens > mt:
            raise BadRequest("min_tokens must be between 0 and max_tokens", "min_tokens")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean", "stream")
        so = body.get("stream_options") or {}
        include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        return prompt, mt, stream, include_usage

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return vllm_error(400, f"invalid JSON body: {e}")
        try:
            prompt, max_tokens, stream, include_usage = self._parse(body, chat)
        except BadRequest as e:
            return vllm_error(e.status, e.message, e.param)
        tokens = split_tokens(prompt)
        n_prompt = max(1, len(tokens))
        if n_prompt + max_tokens > self.profile.max_model_len:
            return vllm_error(
                400,
                f"This model's maximum context length is {self.profile.max_model_len} tokens. However, "
                f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, "
                f"{max_tokens} in the completion).",
            )
        # the filler never emits EOS, so every request generates exactly max_tokens
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        hashes = chained_block_hashes(tokens, self.engine.block_size)
        now = loop.time()
        try:
            self.engine.add_request(rid, n_prompt, hashes, max_tokens, now)
        except ValueError as e:
            return vllm_error(400, str(e))
        st = self.streams[rid] = _Stream(arrival=now, last_token_at=now)
        self._work.set()
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        produced = 0
        resp: web.StreamResponse | None = None
        try:
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                   "Cache-Control": "no-cache"})
                await resp.prepare(request)
            while True:
                kind, n = await st.queue.get()
                t = loop.time()
                if kind == "tokens":
                    if produced == 0:
                        self.ttft.observe(t - st.arrival, *self._lv)
                    else:
                        self.itl.observe((t - st.last_token_at) / max(1, n), *self._lv)
                    words = filler_tokens(n, produced)
                    produced += n
                    st.last_token_at = t
                    if resp is not None:
                        text = "".join(" " + w for w in words)
                        if chat:
                            delta: dict[str, Any] = {"content": text}
                            if produced == n:
                                delta = {"role": "assistant", "content": text}
                            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": None}
                        else:
                            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None,
                                      "stop_reason": None}
                        await self._sse(resp, {"id": rid, "object": obj, "created": created,
                                               "model": self.model, "choices": [choice]})
                else:
                    break
            self.e2e.observe(loop.time() - st.arrival, *self._lv)
            self.success.inc("0", self.model, "length")
            usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + produced,
                     "completion_tokens": produced, "prompt_tokens_details": None}
            if resp is not None:
                fin: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
                                       if chat else
                                       {"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                                        "stop_reason": None})
                await self._sse(resp, {"id": rid, "object": obj, "created": created, "model": self.model,
                                       "choices": [fin]})
                if include_usage:
                    await self._sse(resp, {"id": rid, "object": obj, "created": created, "model": self.model,
                                           "choices": [], "usage": usage})
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            text = "".join(" " + w for w in filler_tokens(produced))
            if chat:
                choices = [{"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                            "logprobs": None, "finish_reason": "length", "stop_reason": None}]
                full_obj = "chat.completion"
            else:
                choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                            "stop_reason": None}]
                full_obj = "text_completion"
            return web.json_response({"id": rid, "object": full_obj, "created": created, "model": self.model,
                                      "choices": choices, "usage": usage})
        finally:
            self.streams.pop(rid, None)
            if self.engine.abort(rid):  # still in the engine: the client went away
                self.success.inc("0", self.model, "abort")
                self._work.set()

    @staticmethod
    async def _sse(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def start_replica(host: str = "127.0.0.1", port: int = 0, profile: str = "l4-llama3.1-8b",
                        time_scale: float = 1.0, model: str = "skymesh-sim",
                        **engine_overrides: Any) -> ReplicaServer:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r} (known: {', '.join(PROFILES)})")
    srv = ReplicaServer(PROFILES[profile], time_scale, model, **engine_overrides)
    await srv.start(host, port)
    return srv
