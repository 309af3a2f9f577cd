"""The vLLM stand-in's HTTP server: vLLM's OpenAI API and Prometheus metrics over the
pure engine model, so a balancer cannot tell it from vLLM for routing purposes.

One asyncio task runs the engine: ``out = engine.step(t)``, sleep ``out.duration_s``, hand
the step's tokens to the waiting handlers. Steps are laid end to end on a virtual clock
(``t`` is the previous step's end, not the time the sleep happened to wake up), so event
loop wake-up jitter does not slow the modelled GPU down.

Tokens: whitespace words (skymesh/word_tokenizer.py), or with ``tokenizer`` (a local HF
``tokenizer.json``) the model's token ids, kept as decimal strings so the engine's block
hashes and the KV events' ``token_ids`` are the tokenizer's. KV events: with a
``KVEventsConfig`` that publishes, each engine step's cache changes go out as one vLLM
0.32 batch at the end of the step (skymesh/replica_sim/kv_publisher.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from skymesh.edge.connection_metrics import EdgeMetrics
from skymesh.edge.server import EdgeAppRunner, EdgeLimits, site_port
from skymesh.replica_sim.block_pool import chained_block_hashes
from skymesh.replica_sim.engine import Engine
from skymesh.replica_sim.kv_events import KVEventsConfig
from skymesh.replica_sim.kv_publisher import EventPublisher, NullPublisher, make_publisher
from skymesh.replica_sim.profiles import PROFILES, Profile
from skymesh.replica_sim.request_state import EngineRequest
from skymesh.replica_sim.vllm_metrics import ReplicaMetrics, vllm_cache_config_info
from skymesh.runtime.supervise import SupervisedLoop
from skymesh.word_tokenizer import (
    GENERATION_PROMPT,
    ChatContentError,
    chat_prompt,
    filler_tokens,
    split_tokens,
    word_token_id,
)

log = logging.getLogger("skymesh.replica_sim")

# vLLM 0.32's CompletionRequest.max_tokens default (a null max_tokens is read as it too);
# a chat request has no default: it may fill the context (max_model_len - prompt tokens)
DEFAULT_MAX_TOKENS = 16
# vLLM's VLLM_MAX_COMPLETION_PROMPTS: the longest batch of prompts one completion takes
MAX_COMPLETION_PROMPTS = 1024
# if the event loop falls this far behind the virtual clock (a stalled machine), the
# clock is re-anchored instead of running the backlog of steps back to back
MAX_CLOCK_LAG_S = 0.25
# /health fails (503, as vLLM's does when its engine is dead) once the engine loop has
# crashed this many times in a row without a successful step in between: a crashing engine
# must not hide behind a server that still answers
ENGINE_UNHEALTHY_AFTER_CRASHES = 3
ENGINE_LOOP_NAME = "engine"
# vLLM's uvicorn closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
STAND_IN_EDGE = EdgeLimits(header_timeout_s=5.0)
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def validation_error(message: str, parameter: str | None = None, value: Any = None) -> ApiError:
    """A 400 as vLLM 0.32 answers a ``VLLMValidationError``: the body's message is the
    exception's ``str()``, which appends ``(parameter=..., value=...)`` for whichever of
    the two is set, and ``param`` is the parameter (vllm/exceptions.py,
    entrypoints/serve/exception_handling/error_response.py)."""
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    return ApiError(f"{message} ({', '.join(extras)})" if extras else message, parameter)


def vllm_error(status: int, message: str, param: str | None = None) -> web.Response:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _ERROR_TYPES.get(status, "InternalServerError")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


@dataclass
class GenRequest:
    """A validated generation request: one engine request per prompt (a completion may
    carry a batch of prompts; a chat carries one)."""

    prompts: list[list[str]]
    max_tokens: list[int]  # per prompt, after vLLM's clamp to the context left
    stream: bool
    include_usage: bool

    @property
    def prompt_tokens(self) -> list[str]:
        """The (first) prompt's tokens."""
        return self.prompts[0]


# what the engine loop hands a handler: (kind, tokens, time, prompt index) with kind
# "tokens", "finished" or "error"
_Event = tuple[str, int, float, int]


@dataclass
class _Stream:
    """One engine request's link to its handler: the handler's queue (shared by all the
    prompts of one request) and the prompt's index in it."""

    queue: asyncio.Queue[_Event] = field(default_factory=asyncio.Queue)
    index: int = 0


def _dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


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
    an over-long prompt's length is reported); token-id prompts are plain lists."""


def _bool_param(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{key} must be a boolean", key)
    return v


class ReplicaServer:
    def __init__(self, profile: Profile, time_scale: float = 1.0, model: str = "skymesh-sim", *,
                 tokenizer: str | Path | None = None, kv_events: KVEventsConfig | None = None,
                 enable_prompt_tokens_details: bool = False, **engine_overrides: Any) -> None:
        self.profile = profile
        # vLLM's --enable-prompt-tokens-details: usage reports the prompt tokens found in
        # the prefix cache
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.model = model
        self.engine = Engine(profile, time_scale=time_scale, **engine_overrides)
        self.tokenizer: Any = None
        # the id of every generated token with a tokenizer (the filler's text " tok<i>"
        # is not one token of a real vocabulary; its first piece stands for each)
        self._generated_id = "0"
        if tokenizer is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tokenizer))
            ids = self.tokenizer.encode(" tok", add_special_tokens=False).ids
            self._generated_id = str(ids[0] if ids else 0)
        self.kv_events_config = kv_events
        self.kv_publisher: EventPublisher = NullPublisher()
        if kv_events is not None and kv_events.publishes:
            self.engine.enable_kv_events()
        self.metrics = ReplicaMetrics(self.engine, model, profile.max_model_len, cache_config_info=vllm_cache_config_info(
            num_gpu_blocks=self.engine.num_blocks, block_size=self.engine.block_size,
            max_model_len=profile.max_model_len, gpu_memory_utilization=profile.gpu_memory_utilization,
            num_gpu_blocks_override=engine_overrides.get("num_gpu_blocks"),
            user_specified_block_size=engine_overrides.get("block_size") is not None))
        self.streams: dict[str, _Stream] = {}
        self._work = asyncio.Event()
        self.engine_loop = SupervisedLoop(ENGINE_LOOP_NAME, self._run_engine, on_restart=self._engine_restarted,
                                          logger=log, backoff_s=0.05, max_backoff_s=2.0)
        self._loop_task: asyncio.Task[None] | None = None
        self._runner: EdgeAppRunner | None = None
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
            # this step's cache changes, published when the step is over (vLLM publishes
            # in update_from_output, after the forward pass)
            kv_events = engine.take_kv_events()
            if out.steps == 0:
                # nothing can run until a request arrives or leaves
                t = None
                self._work.clear()
                await self._work.wait()
                continue
            self.engine_loop.mark_healthy()  # a completed step ends a crash streak
            t += out.duration_s
            await asyncio.sleep(max(0.0, t - loop.time()))
            if kv_events:
                self.kv_publisher.publish(kv_events)  # never blocks
            # handlers time-stamp tokens with the real delivery time: what a client sees
            delivered = loop.time()
            streams = self.streams
            for rid, n in out.tokens:
                s = streams.get(rid)
                if s is not None:
                    s.queue.put_nowait(("tokens", n, delivered, s.index))
            for rid in out.finished:
                s = streams.get(rid)
                if s is not None:
                    s.queue.put_nowait(("finished", 0, delivered, s.index))

    def _fail_all(self) -> None:
        """Answer every open request with an error and start the engine over empty.

        Requests are not aborted one by one: a step that raised halfway may have left the
        engine's queues inconsistent, so ``abort`` could raise here too (and used to kill
        the loop from inside its own error handler). Each handler sees the error, answers
        500 and returns; its ``abort`` then finds nothing, so nothing is counted twice."""
        self.engine.drop_all_requests()
        for s in self.streams.values():
            s.queue.put_nowait(("error", 0, 0.0, s.index))

    # ------------------------------------------------------------------ lifecycle

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        # the event sockets first: a bad endpoint fails the start before anything runs
        self.kv_publisher = make_publisher(self.kv_events_config, host)
        self._loop_task = self.engine_loop.start()
        # handler_cancellation: a client that disconnects cancels its handler, whose
        # finally-block aborts the request in the engine
        # EdgeAppRunner: bounded heads and connections, and no Content-Encoding inflated (as
        # vLLM's uvicorn: a coded body fails as JSON). Its counters stay off /metrics, which
        # is vLLM's page (skymesh/edge/server.py)
        self._runner = EdgeAppRunner(self.make_app(), metrics=EdgeMetrics.create(None), limits=STAND_IN_EDGE,
                                     handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        self.host = host
        self.port = site_port(site)
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
        publisher, self.kv_publisher = self.kv_publisher, NullPublisher()
        await asyncio.to_thread(publisher.close)  # sends what is queued, joins its thread

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

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev endpoint (``VLLM_SERVER_DEV_MODE=1``): ``{"success": bool}``, false
        while a request holds KV blocks. Its ``AllBlocksCleared`` goes out with the next
        step's batch, as vLLM's does (events are published by engine steps)."""
        return web.json_response({"success": self.engine.reset_prefix_cache()})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # ------------------------------------------------------------------ generation

    def parse(self, body: Any, chat: bool) -> GenRequest:
        """Validate a request body the way vLLM 0.32 does, in its order: the request's own
        fields, the model, the output budget against the context, each prompt's length,
        then the sampling parameters with ``max_tokens`` clamped to the context left."""
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        max_len = self.profile.max_model_len
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
            if _bool_param(body, "add_generation_prompt", True):
                text = f"{text} {GENERATION_PROMPT}" if text else GENERATION_PROMPT
            # a chat prompt carries its own special tokens (vLLM encodes a rendered chat
            # template without adding any), as the balancer encodes it too
            prompts = [self._text_tokens(text, special_tokens=False)]
            # max_completion_tokens first, max_tokens when it is null; none: no limit
            # but the context (vLLM's chat default)
            budget_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
                else "max_tokens"
            requested = _int_param(body, budget_param, None)
        else:
            prompts = self._prompts(body.get("prompt"))
            budget_param = "max_tokens"
            requested = _int_param(body, "max_tokens", DEFAULT_MAX_TOKENS)
        min_tokens = _int_param(body, "min_tokens", 0)
        assert min_tokens is not None
        _bool_param(body, "ignore_eos", False)  # the filler never emits EOS: lengths are exact
        n = _int_param(body, "n", 1)
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
        model = body.get("model")
        if model is not None and model != self.model:  # vLLM serves a missing model too
            # vLLM 0.32 (entrypoints/serve/engine/serving.py _check_model) names what it serves
            raise ApiError(f"The model `{model}` does not exist. Valid aliases: {self.model}.", "model", 404)
        # the renderer's TokenizeParams (vllm/renderers/params.py): an output budget
        # longer than the whole context is refused before any prompt is looked at
        if requested is not None and requested > max_len:
            raise validation_error(f"{budget_param}={requested} cannot be greater than max_model_len="
                                   f"{max_len}. Please request fewer output tokens.", budget_param, requested)
        for tokens in prompts:
            self._check_prompt_length(tokens, text_prompt=chat or isinstance(tokens, _TextTokens))
        budgets: list[int] = []
        for tokens in prompts:
            # vllm/entrypoints/serve/utils/api_utils.py get_max_tokens: the request's
            # budget (or the default) never past the context the prompt leaves
            left = max_len - len(tokens)
            budget = left if requested is None else min(left, requested)
            # SamplingParams: the clamped budget is what is checked
            if budget < 1:
                raise validation_error(f"max_tokens must be at least 1, got {budget}.", "max_tokens", budget)
            if min_tokens < 0:
                raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
            if min_tokens > budget:
                raise ApiError(f"min_tokens must be less than or equal to max_tokens={budget}, got {min_tokens}.")
            budgets.append(budget)
        return GenRequest(prompts, budgets, stream, include_usage)

    def _check_prompt_length(self, tokens: list[str], text_prompt: bool) -> None:
        """vLLM 0.32 refuses a prompt only when it alone is longer than the context
        (TokenizeParams._token_len_check). A text prompt is tokenized with truncation at
        max_model_len + 1, so its count stops there and reads "at least"; token ids are
        counted as given."""
        max_len = self.profile.max_model_len
        if len(tokens) <= max_len:
            if not tokens:
                raise ApiError("The decoder prompt cannot be empty")
            return
        count = min(len(tokens), max_len + 1) if text_prompt else len(tokens)
        qualifier = "at least " if count == max_len + 1 else ""
        raise validation_error(
            f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
            f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.", "input_tokens", count)

    def _text_tokens(self, text: str, special_tokens: bool = True) -> list[str]:
        """A text's tokens: its words, or its token ids (as decimal strings) with a
        tokenizer, special tokens (BOS) added as vLLM adds them to a completion prompt."""
        if self.tokenizer is None:
            return split_tokens(text)
        return [str(i) for i in self.tokenizer.encode(text, add_special_tokens=special_tokens).ids]

    def _filler_hash_tokens(self, n: int) -> list[str]:
        """The output's tokens as the engine hashes them (generated blocks are cached)."""
        if self.tokenizer is None:
            return filler_tokens(n)
        return [self._generated_id] * n

    def _prompts(self, prompt: Any) -> list[list[str]]:
        """The prompts of a completion request, as vLLM's ``CompletionRequest.prompt``
        takes them: a string, a list of strings, a list of token ids, or a list of lists of
        token ids (one prompt each). Token ids keep their identity as words (``"17"``), so
        prefix caching still sees equal prefixes."""
        if prompt is None or prompt == "":
            raise validation_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str):
            return [_TextTokens(self._text_tokens(prompt))]
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
            return [_TextTokens(self._text_tokens(x)) for x in prompt]
        if all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in prompt):
            return [[str(t) for t in x] for x in prompt]
        raise ApiError("prompt must be a string, a list of strings, a list of token ids (>= 0), "
                       "or a list of lists of token ids", "prompt")

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
        queue: asyncio.Queue[_Event] = asyncio.Queue()
        # one engine request per prompt, as vLLM schedules a batch ("{id}-{i}")
        erids = [f"{rid}-{i}" for i in range(len(g.prompts))]
        ereqs: list[EngineRequest] = []
        bs = self.engine.block_size
        with_ids = self.engine.kv_events is not None
        try:
            try:
                for i, (tokens, budget) in enumerate(zip(g.prompts, g.max_tokens, strict=True)):
                    # the hashes cover the prompt and the output the filler will produce, so
                    # the engine caches full blocks of generated tokens too, as vLLM does
                    seq = [*tokens, *self._filler_hash_tokens(budget)]
                    self.engine.add_request(erids[i], len(tokens), chained_block_hashes(seq, bs), budget, arrival,
                                            token_ids=[word_token_id(w) for w in seq] if with_ids else None)
                    ereqs.append(self.engine.requests[erids[i]])
                    self.streams[erids[i]] = _Stream(queue, i)
            except ValueError as e:  # longer than the whole KV cache
                return vllm_error(400, str(e))
            self._work.set()
            return await self._respond(request, rid, chat, g, queue, ereqs, arrival)
        finally:
            for i, erid in enumerate(erids):
                self.streams.pop(erid, None)
                if self.engine.abort(erid):  # still in the engine: the client went away
                    self.metrics.finished("abort", 0.0, 0.0, 0.0, 0.0, len(g.prompts[i]), ereqs[i].output_tokens)
                    self._work.set()

    async def _respond(self, request: web.Request, rid: str, chat: bool, g: GenRequest,
                       queue: asyncio.Queue[_Event], ereqs: list[EngineRequest],
                       arrival: float) -> web.StreamResponse:
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
            written = len(g.prompts[0]) // self.engine.block_size * self.engine.block_size - e.cached_tokens
            return {"cached_tokens": e.cached_tokens, "created_cache_tokens": max(0, written),
                    "multimodal_tokens": None}
        if stream:
            return {"cached_tokens": e.cached_tokens}
        return {"cached_tokens": e.cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}

    @staticmethod
    async def _sse(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + _dumps(payload) + b"\n\n")


async def start_replica(host: str = "127.0.0.1", port: int = 0, profile: str = "l4-llama3.1-8b",
                        time_scale: float = 1.0, model: str = "skymesh-sim", *,
                        tokenizer: str | Path | None = None, kv_events: KVEventsConfig | None = None,
                        enable_prompt_tokens_details: bool = False, **engine_overrides: Any) -> ReplicaServer:
    """Start a stand-in replica in this event loop (``await srv.close()`` to stop it)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r} (known: {', '.join(PROFILES)})")
    srv = ReplicaServer(PROFILES[profile], time_scale, model, tokenizer=tokenizer, kv_events=kv_events,
                        enable_prompt_tokens_details=enable_prompt_tokens_details, **engine_overrides)
    try:
        await srv.start(host, port)
    except BaseException:
        await srv.close()
        raise
    return srv
