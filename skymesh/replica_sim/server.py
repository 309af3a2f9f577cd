"""The vLLM stand-in's HTTP server: vLLM's OpenAI API and Prometheus metrics over the
pure engine model, so a balancer cannot tell it from vLLM for routing purposes.

One asyncio task runs the engine: ``out = engine.step(t)``, sleep ``out.duration_s``, hand
the step's tokens to the waiting handlers. Steps are laid end to end on a virtual clock
(``t`` is the previous step's end, not the time the sleep happened to wake up), so event
loop wake-up jitter does not slow the modelled GPU down.
"""

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
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from skymesh.replica_sim.engine import Engine, EngineRequest, chained_block_hashes
from skymesh.replica_sim.metrics import ReplicaMetrics
from skymesh.replica_sim.profiles import PROFILES, Profile
from skymesh.supervise import SupervisedLoop
from skymesh.tokens import ChatContentError, chat_prompt, filler_tokens, split_tokens

log = logging.getLogger("skymesh.replica_sim")

DEFAULT_MAX_TOKENS = 16
# if the event loop falls this far behind the virtual clock (a stalled machine), the
# clock is re-anchored instead of running the backlog of steps back to back
MAX_CLOCK_LAG_S = 0.25
# /health fails (503, as vLLM's does when its engine is dead) once the engine loop has
# crashed this many times in a row without a successful step in between: a crashing engine
# must not hide behind a server that still answers
ENGINE_UNHEALTHY_AFTER_CRASHES = 3
ENGINE_LOOP_NAME = "engine"
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def vllm_error(status: int, message: str, param: str | None = None) -> web.Response:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _ERROR_TYPES.get(status, "InternalServerError")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


@dataclass
class GenRequest:
    """A validated generation request."""

    prompt_tokens: list[str]
    max_tokens: int
    stream: bool
    include_usage: bool


@dataclass
class _Stream:
    """What the engine loop hands one handler: ("tokens", n, t) / ("finished", 0, t) /
    ("error", 0, t)."""

    queue: asyncio.Queue[tuple[str, int, float]] = field(default_factory=asyncio.Queue)


def _dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def _int_param(body: dict[str, Any], key: str, default: int | None, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(f"{key} must be an integer, got {type(v).__name__}", key)
    if v < lo:
        raise ApiError(f"{key} must be at least {lo}, got {v}.", key)
    return v


def _bool_param(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{key} must be a boolean", key)
    return v


class ReplicaServer:
    def __init__(self, profile: Profile, time_scale: float = 1.0, model: str = "skymesh-sim",
                 **engine_overrides: Any) -> None:
        self.profile = profile
        self.model = model
        self.engine = Engine(profile, time_scale=time_scale, **engine_overrides)
        self.metrics = ReplicaMetrics(self.engine, model, profile.max_model_len)
        self.streams: dict[str, _Stream] = {}
        self._work = asyncio.Event()
        self.engine_loop = SupervisedLoop(ENGINE_LOOP_NAME, self._run_engine, on_restart=self._engine_restarted,
                                          logger=log, backoff_s=0.05, max_backoff_s=2.0)
        self._loop_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.host = "127.0.0.1"
        self.port = 0

    # ------------------------------------------------------------------ engine loop

    async def _run_engine(self) -> None:
        """The supervised body: the engine loop, failing every open request when it raises."""
        try:
            await self._engine_loop()
        except Exception:
            self._fail_all()
            raise  # to the supervisor: logged, counted, restarted after a backoff

    def _engine_restarted(self, name: str, exc: BaseException) -> None:
        self.metrics.loop_restarts.labels(name).inc()

    def engine_healthy(self) -> bool:
        task = self._loop_task
        return (task is not None and not task.done()
                and self.engine_loop.failure_streak < ENGINE_UNHEALTHY_AFTER_CRASHES)

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        t: float | None = None  # virtual end of the previous step while the engine is busy
        while True:
            if not engine.has_work():
                t = None
                self._work.clear()
                await self._work.wait()
                continue
            now = loop.time()
            if t is None or t < now - MAX_CLOCK_LAG_S:
                t = now
            out = engine.step(t)  # raising fails the open requests (_run_engine)
            if out.steps == 0:
                # nothing can run until a request arrives or leaves
                t = None
                self._work.clear()
                await self._work.wait()
                continue
            self.engine_loop.mark_healthy()  # a completed step ends a crash streak
            t += out.duration_s
            await asyncio.sleep(max(0.0, t - loop.time()))
            # handlers time-stamp tokens with the real delivery time: what a client sees
            delivered = loop.time()
            streams = self.streams
            for rid, n in out.tokens:
                s = streams.get(rid)
                if s is not None:
                    s.queue.put_nowait(("tokens", n, delivered))
            for rid in out.finished:
                s = streams.get(rid)
                if s is not None:
                    s.queue.put_nowait(("finished", 0, delivered))

    def _fail_all(self) -> None:
        """Answer every open request with an error and start the engine over empty.

        Requests are not aborted one by one: a step that raised halfway may have left the
        engine's queues inconsistent, so ``abort`` could raise here too (and used to kill
        the loop from inside its own error handler). Each handler sees the error, answers
        500 and returns; its ``abort`` then finds nothing, so nothing is counted twice."""
        self.engine.drop_all_requests()
        for s in self.streams.values():
            s.queue.put_nowait(("error", 0, 0.0))

    # ------------------------------------------------------------------ lifecycle

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._loop_task = self.engine_loop.start()
        # handler_cancellation: a client that disconnects cancels its handler, whose
        # finally-block aborts the request in the engine
        self._runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False,
                                     handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        self.host = host
        server = site._server
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]
        log.info("replica-sim listening", extra={"url": self.url, "profile": self.profile.name,
                                                 "time_scale": self.engine.time_scale})

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None

    # ------------------------------------------------------------------ small endpoints

    async def _health(self, request: web.Request) -> web.Response:
        # vLLM answers an empty 200, or an empty 503 when its engine is dead
        return web.Response(status=200 if self.engine_healthy() else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        # text format 0.0.4, what vLLM's /metrics (prometheus_client's exporter) answers a
        # plain scrape; CONTENT_TYPE_LATEST would now say version=1.0.0 over the same body
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.profile.max_model_len,
            "permission": [],
        }]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # ------------------------------------------------------------------ generation

    def parse(self, body: Any, chat: bool) -> GenRequest:
        """Validate a request body the way vLLM does (same params, same error shape)."""
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:  # vLLM serves a missing model too
            raise ApiError(f"The model `{model}` does not exist.", "model", 404)
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs
            ):
                raise ApiError("messages must be a non-empty list of {role, content} objects", "messages")
            try:
                tokens = split_tokens(chat_prompt(msgs))
            except ChatContentError as e:  # a content part vLLM would refuse too
                raise ApiError(str(e), e.param) from None
            max_tokens = _int_param(body, "max_completion_tokens", None, 1)
            if max_tokens is None:
                max_tokens = _int_param(body, "max_tokens", DEFAULT_MAX_TOKENS, 1)
        else:
            tokens = self._prompt_tokens(body.get("prompt"))
            max_tokens = _int_param(body, "max_tokens", DEFAULT_MAX_TOKENS, 1)
        assert max_tokens is not None
        if not tokens:
            raise ApiError("The prompt cannot be empty.", "messages" if chat else "prompt")
        min_tokens = _int_param(body, "min_tokens", 0, 0)
        assert min_tokens is not None
        if min_tokens > max_tokens:
            raise ApiError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                           f"got {min_tokens}.", "min_tokens")
        _bool_param(body, "ignore_eos", False)  # the filler never emits EOS: lengths are exact
        n = _int_param(body, "n", 1, 1)
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
        total = len(tokens) + max_tokens
        if total > self.profile.max_model_len:
            raise ApiError(
                f"This model's maximum context length is {self.profile.max_model_len} tokens. However, "
                f"you requested {total} tokens ({len(tokens)} in the messages, {max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion."
            )
        return GenRequest(tokens, max_tokens, stream, include_usage)

    @staticmethod
    def _prompt_tokens(prompt: Any) -> list[str]:
        # a one-element batch is the same prompt; token-id prompts keep their identity as
        # words so prefix caching still sees equal prefixes
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return split_tokens(prompt)
        if isinstance(prompt, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return [str(x) for x in prompt]
        raise ApiError("prompt must be a string, a list of token ids, or a list with one of those", "prompt")

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return vllm_error(400, f"invalid JSON body: {e}")
        try:
            g = self.parse(body, chat)
        except ApiError as e:
            return vllm_error(e.status, e.message, e.param)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        arrival = loop.time()
        n_prompt = len(g.prompt_tokens)
        try:
            self.engine.add_request(rid, n_prompt, chained_block_hashes(g.prompt_tokens, self.engine.block_size),
                                    g.max_tokens, arrival)
        except ValueError as e:  # longer than the whole KV cache
            return vllm_error(400, str(e))
        ereq = self.engine.requests[rid]
        st = self.streams[rid] = _Stream()
        self._work.set()
        try:
            return await self._respond(request, rid, chat, g, st, ereq, arrival)
        finally:
            self.streams.pop(rid, None)
            if self.engine.abort(rid):  # still in the engine: the client went away
                self.metrics.finished("abort", 0.0, 0.0, 0.0, 0.0, n_prompt, ereq.output_tokens)
                self._work.set()

    async def _respond(self, request: web.Request, rid: str, chat: bool, g: GenRequest, st: _Stream,
                       ereq: EngineRequest, arrival: float) -> web.StreamResponse:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": self.model}
        resp: web.StreamResponse | None = None
        if g.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
        produced = 0
        first_at = last_at = arrival
        while True:
            kind, n, t = await st.queue.get()
            if kind == "error":
                if resp is None:
                    return vllm_error(500, "engine failure")
                await resp.write(b"data: " + _dumps({"error": {"message": "engine failure",
                                                              "type": "InternalServerError",
                                                              "param": None, "code": 500}}) + b"\n\n")
                return resp
            if kind == "finished":
                break
            if produced == 0:
                first_at = t
                self.metrics.ttft.observe(t - arrival)
            else:
                self.metrics.itl.observe(t - last_at)
            last_at = t
            start = produced
            produced += n
            if resp is not None:
                last = produced >= g.max_tokens
                if chat and start == 0:
                    # vLLM opens a chat stream with the role and empty content
                    await self._sse(resp, {**head, "choices": [{
                        "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]})
                text = "".join(" " + w for w in filler_tokens(n, start))
                reason = "length" if last else None
                choice: dict[str, Any] = (
                    {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
                    if chat else
                    {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
                )
                await self._sse(resp, {**head, "choices": [choice]})
        end = last_at
        scheduled = ereq.first_scheduled_at if ereq.first_scheduled_at is not None else arrival
        self.metrics.finished("length", end - arrival, max(0.0, scheduled - arrival), max(0.0, first_at - scheduled),
                              end - first_at, len(g.prompt_tokens), produced)
        usage = {"prompt_tokens": len(g.prompt_tokens), "total_tokens": len(g.prompt_tokens) + produced,
                 "completion_tokens": produced, "prompt_tokens_details": None}
        if resp is not None:
            if g.include_usage:
                await self._sse(resp, {**head, "choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        text = "".join(" " + w for w in filler_tokens(produced))
        if chat:
            choices: list[dict[str, Any]] = [{
                "index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None, "finish_reason": "length", "stop_reason": None}]
        else:
            choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                        "stop_reason": None, "prompt_logprobs": None}]
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": self.model, "choices": choices,
                                  "usage": usage})

    @staticmethod
    async def _sse(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + _dumps(payload) + b"\n\n")


async def start_replica(host: str = "127.0.0.1", port: int = 0, profile: str = "l4-llama3.1-8b",
                        time_scale: float = 1.0, model: str = "skymesh-sim",
                        **engine_overrides: Any) -> ReplicaServer:
    """Start a stand-in replica in this event loop (``await srv.close()`` to stop it)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r} (known: {', '.join(PROFILES)})")
    srv = ReplicaServer(PROFILES[profile], time_scale, model, **engine_overrides)
    await srv.start(host, port)
    return srv
