"""The vLLM stand-in's HTTP server: vLLM's OpenAI API and Prometheus metrics over the
pure engine model, so a balancer cannot tell it from vLLM for routing purposes. This module
wires the app: the endpoints, a generation request's path from parsing
(request_parsing.py) through the engine (engine_loop.py) to its answer (responses.py),
and the server's start and stop. KV events: with a ``KVEventsConfig`` that publishes, each
engine step's cache changes go out as one vLLM 0.32 batch at the end of the step
(kv_publisher.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from skymesh.edge.connection_metrics import EdgeMetrics
from skymesh.edge.server import EdgeAppRunner, EdgeLimits, site_port
from skymesh.hardware import PROFILES, Profile
from skymesh.replica_sim.block_pool import chained_block_hashes
from skymesh.replica_sim.engine import Engine
from skymesh.replica_sim.engine_loop import EngineLoop, Event, Stream
from skymesh.replica_sim.kv_events import KVEventsConfig
from skymesh.replica_sim.kv_publisher import make_publisher
from skymesh.replica_sim.kv_transfer import (
    REQUIRED_REMOTE_FIELDS,
    KVTransfer,
    KVTransferMetrics,
    KVTransferSettings,
    TransferFailed,
    allowed_remote,
    transfer_seconds,
)
from skymesh.replica_sim.request_parsing import ApiError, GenRequest, RequestParser
from skymesh.replica_sim.request_state import EngineRequest
from skymesh.replica_sim.responses import ResponseWriter, generation_error, vllm_error
from skymesh.replica_sim.tokenization import StandInTokenizer
from skymesh.replica_sim.vllm_metrics import ENGINE_INDEX, ReplicaMetrics, vllm_cache_config_info
from skymesh.word_tokenizer import word_token_id

log = logging.getLogger("skymesh.replica_sim")

# vLLM's uvicorn closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
STAND_IN_EDGE = EdgeLimits(header_timeout_s=5.0)


class ReplicaServer:
    def __init__(self, profile: Profile, time_scale: float = 1.0, model: str = "skymesh-sim", *,
                 tokenizer: str | Path | None = None, kv_events: KVEventsConfig | None = None,
                 enable_prompt_tokens_details: bool = False, kv_transfer: KVTransferSettings | None = None,
                 **engine_overrides: Any) -> None:
        self.profile = profile
        self.model = model
        self.engine = Engine(profile, time_scale=time_scale, **engine_overrides)
        self.tokens = StandInTokenizer(tokenizer)
        self.parser = RequestParser(model, profile.max_model_len, self.tokens)
        # vLLM 0.32 tokenizes in one worker thread (its renderer's AsyncMicrobatchTokenizer,
        # vllm/utils/async_utils.py), not on the API server's loop: a long prompt delays
        # the requests tokenized after it, never /health or /metrics
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="standin-tokenizer")
        self.kv_events_config = kv_events
        if kv_events is not None and kv_events.publishes:
            self.engine.enable_kv_events()
        self.metrics = ReplicaMetrics(self.engine, model, profile.max_model_len, cache_config_info=vllm_cache_config_info(
            num_gpu_blocks=self.engine.num_blocks, block_size=self.engine.block_size,
            max_model_len=profile.max_model_len, gpu_memory_utilization=profile.gpu_memory_utilization,
            num_gpu_blocks_override=engine_overrides.get("num_gpu_blocks"),
            user_specified_block_size=engine_overrides.get("block_size") is not None))
        self.responses = ResponseWriter(model, self.metrics, self.engine.block_size, enable_prompt_tokens_details,
                                        self.tokens)
        self.engine_loop = EngineLoop(self.engine, self.metrics)
        # P/D disaggregation as vLLM's NIXL connector in pull mode (kv_transfer.py);
        # None: no connector, kv_transfer_params are ignored as vLLM ignores them
        self.kv: KVTransfer | None = None
        if kv_transfer is not None:
            self.kv = KVTransfer(kv_transfer, self.engine.release_held, self.engine_loop.wake,
                                 KVTransferMetrics(self.metrics.registry, model, ENGINE_INDEX, self.engine))
        self._ignored_kv_params_logged = False
        self._runner: EdgeAppRunner | None = None
        self.host = "127.0.0.1"
        self.port = 0

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
        self.engine_loop.start(make_publisher(self.kv_events_config, host))
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
        if self.kv is not None:
            await self.kv.start(host, self.port)
        log.info("replica-sim listening", extra={"url": self.url, "profile": self.profile.name,
                                                 "time_scale": self.engine.time_scale})

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.kv is not None:
            await self.kv.close()
        await self.engine_loop.stop()  # then the KV event publisher sends what is queued
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ small endpoints

    async def _health(self, request: web.Request) -> web.Response:
        # vLLM answers an empty 200, or an empty 503 when its engine is dead
        return web.Response(status=200 if self.engine_loop.healthy() else 503)

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

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return vllm_error(400, f"invalid JSON body: {e}")
        try:
            g = await loop.run_in_executor(self._tokenizer_thread, self.parser.parse, body, chat)
        except ApiError as e:
            await self._free_rejected(body)
            return vllm_error(e.status, e.message, e.param, e.kind)
        # vLLM's _base_request_id: the X-Request-Id header when sent, else a fresh one
        external_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{external_id}"
        arrival = loop.time()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        # one engine request per prompt and choice, as vLLM schedules a batch ("{id}-{i}")
        # and the n samples of a prompt (one child request each): s = prompt * n + choice;
        # each engine adds its own suffix (vLLM's "-<8 hex>"), so two legs of one request
        # sent with the same X-Request-Id never collide
        erids = [f"{rid}-{s}-{uuid.uuid4().hex[:8]}" for s in range(len(g.prompts) * g.n)]
        ereqs: list[EngineRequest] = []
        bs = self.engine.block_size
        with_ids = self.engine.kv_events is not None
        hold, pull = self._kv_roles(g)
        hashes = [chained_block_hashes([*tokens, *self.tokens.filler_hash_tokens(budget)], bs)
                  for tokens, budget in zip(g.prompts, g.max_tokens, strict=True)]
        external = 0
        if pull is not None:
            pulled = await self._pull(request, g, pull, hashes[0])
            if not isinstance(pulled, bool):
                return pulled  # the failed load's answer (policy "fail")
            if pulled:
                external = len(g.prompts[0])
        answered = False
        try:
            try:
                for i in range(len(erids)):
                    tokens, budget = g.prompts[i // g.n], g.max_tokens[i // g.n]
                    # the hashes cover the prompt and the output the filler will produce, so
                    # the engine caches full blocks of generated tokens too, as vLLM does
                    seq = [*tokens, *self.tokens.filler_hash_tokens(budget)]
                    self.engine.add_request(erids[i], len(tokens), hashes[i // g.n], budget, arrival,
                                            token_ids=[word_token_id(w) for w in seq] if with_ids else None,
                                            external_tokens=external if i == 0 else 0, hold_blocks=hold)
                    ereqs.append(self.engine.requests[erids[i]])
                    self.engine_loop.streams[erids[i]] = Stream(queue, i)
            except ValueError as e:  # longer than the whole KV cache
                if pull is not None and not external:
                    await self._free_rejected(body)
                return vllm_error(400, str(e))
            self.engine_loop.wake()
            kv_params = (lambda: self._prefill_params(erids[0], ereqs[0])) if hold else None
            resp = await self.responses.respond(request, rid, chat, g, queue, ereqs, arrival, kv_params)
            answered = True
            return resp
        finally:
            for i, erid in enumerate(erids):
                self.engine_loop.streams.pop(erid, None)
                if self.engine.abort(erid):  # still in the engine: the client went away
                    self.metrics.finished("abort", 0.0, 0.0, 0.0, 0.0, len(g.prompts[i // g.n]),
                                          ereqs[i].output_tokens)
                    self.engine_loop.wake()
                if hold and self.kv is not None and erid in self.engine.held:
                    if answered:  # held for the decode side, under a lease
                        self.kv.lease(erid, ereqs[i].num_computed)
                    else:  # vLLM's connector frees an unfinished request's blocks at once
                        self.kv.drop(erid)

    # ------------------------------------------------------------------ P/D (NIXL pull)

    async def _free_rejected(self, body: Any) -> None:
        """A decode leg refused before the engine frees its prefill replica's blocks
        (vLLM's ``_with_kv_transfer_rejection_cleanup``)."""
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if self.kv is None or not isinstance(params, dict) or not self._valid_pull(params):
            return
        await self.kv.notify_free(params)

    def _valid_pull(self, params: dict[str, Any]) -> bool:
        assert self.kv is not None
        return bool(params.get("do_remote_prefill")) and all(
            params.get(k) is not None for k in REQUIRED_REMOTE_FIELDS) and allowed_remote(
            params.get("remote_host"), params.get("remote_port"), self.kv.settings.peers)

    def _kv_roles(self, g: GenRequest) -> tuple[bool, dict[str, Any] | None]:
        """(prefill leg: hold the blocks, decode leg's params to pull with) as vLLM's NIXL
        connector reads ``kv_transfer_params``."""
        params = g.kv_transfer_params
        if params is None:
            return False, None
        if self.kv is None:
            if not self._ignored_kv_params_logged:
                self._ignored_kv_params_logged = True
                log.warning("Got kv_transfer_params, but no KVConnector found. Disabling KVTransfer for this request.")
            return False, None
        if params.get("do_remote_decode"):
            return True, None
        if not params.get("do_remote_prefill"):
            return False, None
        if not self._valid_pull(params):
            # vLLM recomputes (pull_scheduler.py); the stand-in also never dials a host
            # that is not a loopback IP literal or a configured peer
            log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params)
            return False, None
        cached = params.get("remote_prefill_cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            g.remote_prefill_cached_tokens = cached
        return False, params

    async def _pull(self, request: web.Request, g: GenRequest, params: dict[str, Any], hashes: list[int]) -> bool | web.StreamResponse:
        """A decode leg reads its prompt's KV from the prefill replica: the modelled
        transfer moves the tokens not in this replica's own prefix cache. True: read;
        False: failed, to be recomputed (policy "recompute"); else the failure's answer."""
        kv = self.kv
        assert kv is not None
        plen = len(g.prompts[0])
        cached = self.engine.cached_prefix_tokens(hashes, plen)
        moved = max(0, plen - cached)
        seconds = transfer_seconds(moved, self.profile.kv_bytes_per_token, kv.settings) * self.engine.time_scale
        try:
            await kv.pull(params, seconds)
        except TransferFailed as e:
            log.warning("KV load failed for remote request %s: %s", params.get("remote_request_id"), e)
            if kv.settings.load_failure_policy == "fail":
                return await generation_error(request, g.stream)
            return False
        return True

    def _prefill_params(self, erid: str, e: EngineRequest) -> dict[str, Any] | None:
        """NIXL pull's ``kv_transfer_params`` for a finished prefill leg
        (nixl/pull_scheduler.py ``request_finished``, plus the scheduler's
        ``remote_prefill_cached_tokens``); None when nothing is held (aborted)."""
        kv = self.kv
        blocks = self.engine.held.get(erid)
        if kv is None or blocks is None:
            return None
        computed = e.num_computed
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [blocks[:-(-computed // self.engine.block_size)]],
                "remote_engine_id": kv.engine_id, "remote_request_id": erid,
                "remote_host": kv.host, "remote_port": kv.port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": computed, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
                "remote_prefill_cached_tokens": e.cached_tokens}


async def start_replica(host: str = "127.0.0.1", port: int = 0, profile: str = "l4-llama3.1-8b",
                        time_scale: float = 1.0, model: str = "skymesh-sim", *,
                        tokenizer: str | Path | None = None, kv_events: KVEventsConfig | None = None,
                        enable_prompt_tokens_details: bool = False, kv_transfer: KVTransferSettings | None = None,
                        **engine_overrides: Any) -> ReplicaServer:
    """Start a stand-in replica in this event loop (``await srv.close()`` to stop it)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r} (known: {', '.join(PROFILES)})")
    srv = ReplicaServer(PROFILES[profile], time_scale, model, tokenizer=tokenizer, kv_events=kv_events,
                        enable_prompt_tokens_details=enable_prompt_tokens_details, kv_transfer=kv_transfer,
                        **engine_overrides)
    try:
        await srv.start(host, port)
    except BaseException:
        await srv.close()
        raise
    return srv
