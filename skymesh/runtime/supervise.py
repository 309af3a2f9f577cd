"""Supervised background loops: a loop body that raises is logged, counted and restarted.

An unsupervised ``asyncio.create_task(loop())`` dies silently on its first unexpected
exception (the exception is only reported when the task is garbage-collected), leaving
the process up but frozen: a balancer whose probe loop died keeps serving from stale
availability. ``supervise`` runs the body again after a bounded, growing backoff.

Only ``Exception`` is caught: ``asyncio.CancelledError`` (shutdown), ``KeyboardInterrupt``
and ``SystemExit`` propagate. A body that returns normally ends the supervision (a loop
that finished on purpose, e.g. a peer removed from the topology).

Metrics are deliberately not touched here: the caller passes ``on_restart`` and increments
its own counter, so this module works whichever metrics library a component uses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

# A failing body is retried after backoff_s, then twice that, ... up to max_backoff_s.
DEFAULT_BACKOFF_S = 0.1
DEFAULT_MAX_BACKOFF_S = 5.0
# A body that ran this long before raising was healthy: its failure streak starts over.
DEFAULT_HEALTHY_AFTER_S = 30.0
# A loop's traceback is logged at most once per this interval, so a body that fails on
# every run cannot flood the log; the failures in between are counted as "suppressed" in
# the next record (and every one of them still reaches on_restart).
DEFAULT_LOG_INTERVAL_S = 60.0

log = logging.getLogger("skymesh.runtime.supervise")

RestartHook = Callable[[str, BaseException], None]


class SupervisedLoop:
    """Runs ``body`` until cancelled, restarting it whenever it raises.

    State readable by the owner (e.g. for a /health endpoint):
    ``restarts`` (total), ``failure_streak`` (failures since the body last ran healthily),
    ``running`` (the body is running now, not backing off) and ``last_error``.
    """

    def __init__(
        self,
        name: str,
        body: Callable[[], Awaitable[None]],
        *,
        on_restart: RestartHook | None = None,
        logger: logging.Logger | None = None,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        healthy_after_s: float = DEFAULT_HEALTHY_AFTER_S,
        log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if backoff_s < 0 or max_backoff_s < backoff_s:
            raise ValueError("need 0 <= backoff_s <= max_backoff_s")
        self.name = name
        self.body = body
        self.on_restart = on_restart
        self.log = logger or log
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.log_interval_s = log_interval_s
        self._sleep = sleep  # injectable so tests can observe the backoff without waiting
        self.restarts = 0
        self.last_error = ""
        self.running = False
        self._streak = 0
        self._body_started_at = 0.0
        self._last_logged_at: float | None = None
        self._suppressed = 0

    @property
    def failure_streak(self) -> int:
        """Consecutive failures; 0 once the body has run ``healthy_after_s`` without
        raising or has called ``mark_healthy``."""
        if self.running and self._streak and self._now() - self._body_started_at >= self.healthy_after_s:
            self._streak = 0
        return self._streak

    def mark_healthy(self) -> None:
        """Called by a body that knows it made progress (e.g. one successful engine step):
        ends the failure streak at once instead of after ``healthy_after_s``."""
        self._streak = 0

    def next_backoff_s(self) -> float:
        """The pause before the next restart, doubling with every failure of a streak."""
        if self._streak <= 0:
            return 0.0
        # the exponent is capped so a long streak cannot overflow the float
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** min(self._streak - 1, 60))

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    async def run(self) -> None:
        while True:
            self.running = True
            self._body_started_at = self._now()
            try:
                await self.body()
            except Exception as exc:  # anything but cancellation restarts the body
                self.running = False
                self._failed(exc)
                await self._sleep(self.next_backoff_s())
                continue
            finally:
                self.running = False  # also when cancelled
            self.log.info("loop finished", extra={"loop": self.name})
            return

    def _failed(self, exc: Exception) -> None:
        now = self._now()
        if now - self._body_started_at >= self.healthy_after_s:
            self._streak = 0  # it ran healthily before this failure: a new streak
        self._streak += 1
        self.restarts += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self._last_logged_at is None or now - self._last_logged_at >= self.log_interval_s:
            self._last_logged_at = now
            self.log.exception(
                "loop failed; restarting",
                exc_info=exc,
                extra={"loop": self.name, "restarts": self.restarts, "failure_streak": self._streak,
                       "backoff_s": self.next_backoff_s(), "suppressed": self._suppressed},
            )
            self._suppressed = 0
        else:
            self._suppressed += 1
        if self.on_restart is not None:
            try:
                self.on_restart(self.name, exc)
            except Exception:  # a broken counter must not stop the restart
                self.log.exception("on_restart hook failed", extra={"loop": self.name})

    def start(self) -> asyncio.Task[None]:
        """Run under a task named after the loop (cancel it to stop the loop)."""
        return asyncio.create_task(self.run(), name=self.name)
