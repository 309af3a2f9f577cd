"""The daemons' clock for the routing core's ``now``: the one asyncio's ``loop.time()``
reads (monotonic), callable before the event loop runs (a balancer under construction)."""

from __future__ import annotations

import time


def loop_clock() -> float:
    return time.monotonic()
