"""The stand-in's engine loop: one supervised asyncio task that steps the engine, sleeps
each step's modelled duration and hands the step's tokens to the waiting handlers (and its
KV events to the publisher). The HTTP side only registers a stream per engine request and
wakes the loop.

Steps are laid end to end on a virtual clock (``t`` is the previous step's end, not the
time the sleep happened to wake up), so event loop wake-up jitter does not slow the
modelled GPU down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from skymesh.replica_sim.engine import Engine
from skymesh.replica_sim.kv_publisher import EventPublisher, NullPublisher
from skymesh.replica_sim.vllm_metrics import ReplicaMetrics
from skymesh.runtime.supervise import SupervisedLoop

log = logging.getLogger("skymesh.replica_sim")

# if the event loop falls this far behind the virtual clock (a stalled machine), the
# clock is re-anchored instead of running the backlog of steps back to back
MAX_CLOCK_LAG_S = 0.25
# /health fails (503, as vLLM's does when its engine is dead) once the engine loop has
# crashed this many times in a row without a successful step in between: a crashing engine
# must not hide behind a server that still answers
ENGINE_UNHEALTHY_AFTER_CRASHES = 3
ENGINE_LOOP_NAME = "engine"

# what the engine loop hands a handler: (kind, tokens, time, prompt index) with kind
# "tokens", "finished" or "error"
Event = tuple[str, int, float, int]


@dataclass
class Stream:
    """One engine request's link to its handler: the handler's queue (shared by all the
    prompts of one request) and the prompt's index in it."""

    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    index: int = 0


class EngineLoop:
    """The task that drives ``engine``; ``streams`` maps an engine request id to its
    handler's queue."""

    def __init__(self, engine: Engine, metrics: ReplicaMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.kv_publisher: EventPublisher = NullPublisher()
        self.streams: dict[str, Stream] = {}
        self._work = asyncio.Event()
        self.supervisor = SupervisedLoop(ENGINE_LOOP_NAME, self._run_engine, on_restart=self._engine_restarted,
                                         logger=log, backoff_s=0.05, max_backoff_s=2.0)
        self.task: asyncio.Task[None] | None = None

    def start(self, kv_publisher: EventPublisher) -> None:
        self.kv_publisher = kv_publisher
        self.task = self.supervisor.start()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
        publisher, self.kv_publisher = self.kv_publisher, NullPublisher()
        await asyncio.to_thread(publisher.close)  # sends what is queued, joins its thread

    def wake(self) -> None:
        """There may be work: a request arrived or left."""
        self._work.set()

    def healthy(self) -> bool:
        task = self.task
        return (task is not None and not task.done()
                and self.supervisor.failure_streak < ENGINE_UNHEALTHY_AFTER_CRASHES)

    async def _run_engine(self) -> None:
        """The supervised body: the engine loop, failing every open request when it raises."""
        try:
            await self._engine_loop()
        except Exception:
            self._fail_all()
            raise  # to the supervisor: logged, counted, restarted after a backoff

    def _engine_restarted(self, name: str, exc: BaseException) -> None:
        self.metrics.loop_restarts.labels(name).inc()

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
            self.supervisor.mark_healthy()  # a completed step ends a crash streak
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
