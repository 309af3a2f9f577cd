"""The stand-in's hardware/model profiles: the production table of skymesh/hardware.py
(the balancer reads the same profiles; production never imports the stand-in).

Only a re-export, kept while the stand-in's own modules (engine, server, main) and
skymesh/bench/des.py still import from here; everything else imports skymesh.hardware."""

from __future__ import annotations

from skymesh.hardware import (
    PROFILES,
    VLLM_HUGE_GPU_GIB,
    VLLM_LARGE_GPU_GIB,
    Profile,
    prefill_pairs,
    vllm_batch_defaults,
)

__all__ = ["PROFILES", "VLLM_HUGE_GPU_GIB", "VLLM_LARGE_GPU_GIB", "Profile", "prefill_pairs", "vllm_batch_defaults"]
