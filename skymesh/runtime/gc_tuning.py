"""Garbage-collector settings for long-running skymesh processes.

The routing tries hold tens of thousands of small long-lived objects; CPython's default
thresholds make the cyclic collector re-scan them often, which shows up as 100+ µs
pauses in routing decisions. Freezing what exists after start-up and collecting the
young generation less often keeps those pauses off the request path; nothing in skymesh
relies on prompt collection of reference cycles.
"""

from __future__ import annotations

import gc


def tune_gc() -> None:
    gc.collect()
    gc.freeze()  # start-up objects are never scanned again
    gc.set_threshold(50_000, 20, 100)
