"""The event loop every skymesh daemon runs on: uvloop where it loads, else the stdlib's.

One helper, :func:`run_loop`, runs a daemon's main coroutine (the balancer, the
controller, the embedded DNS server through :func:`skymesh.runtime.procs.run_daemon`; the
vLLM stand-in directly). uvloop (libuv, in C) makes each socket read, write and timer of
the hot path cheaper than the stdlib's selector loop (docs/benchmarks.md, "Proxy cost").

``SKYMESH_EVENT_LOOP`` chooses: ``uvloop`` (the default) or ``asyncio`` (the stdlib loop,
e.g. to compare, or to rule the loop out while debugging). Where uvloop was asked for and
cannot be imported (a platform without its wheel, a broken install), the stdlib loop runs
and one warning says why; nothing else changes (both loops run the same code).

gRPC's asyncio API (``grpc.aio``: the peers' heartbeats, the siblings' links, the
controller's services) runs on either loop: it polls its completion queue from its own
thread and hands events to whichever loop is running (tests/test_event_loop.py checks a
call and a stream on uvloop).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV_VAR = "SKYMESH_EVENT_LOOP"
UVLOOP = "uvloop"
STDLIB = "asyncio"
CHOICES = (UVLOOP, STDLIB)

log = logging.getLogger("skymesh.runtime.event_loop")

# the reason the stdlib loop runs where uvloop was asked for (said once per process)
_fallback_said = False


def _warn_once(reason: str) -> None:
    global _fallback_said
    if not _fallback_said:
        _fallback_said = True
        log.warning("uvloop unavailable, running the stdlib event loop: %s", reason)


def wanted_loop(environ: dict[str, str] | None = None) -> str:
    """The loop asked for: ``SKYMESH_EVENT_LOOP`` (``uvloop`` when unset). An unknown
    value is the stdlib loop, with a warning naming the value."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, UVLOOP).strip().lower() or UVLOOP
    if value not in CHOICES:
        log.warning("%s=%r is neither %s: running the stdlib event loop", ENV_VAR, value, " nor ".join(CHOICES))
        return STDLIB
    return value


def loop_factory(environ: dict[str, str] | None = None) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The loop a daemon runs on, by name (``uvloop`` or ``asyncio``), and what makes it."""
    if wanted_loop(environ) == UVLOOP:
        try:
            import uvloop
        except ImportError as e:  # no wheel for this platform, or a broken install
            _warn_once(f"cannot import uvloop ({e})")
        else:
            return UVLOOP, uvloop.new_event_loop
    return STDLIB, asyncio.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """``uvloop`` or ``asyncio``: the kind of ``loop`` (default: the running one)."""
    loop = loop if loop is not None else asyncio.get_running_loop()
    return UVLOOP if type(loop).__module__.startswith("uvloop") else STDLIB


def run_loop(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """``asyncio.run(main)`` on the loop :func:`loop_factory` picks."""
    name, factory = loop_factory()
    log.info("event loop: %s", name, extra={"event_loop": name})
    with asyncio.Runner(loop_factory=factory, debug=debug) as runner:
        return runner.run(main)
