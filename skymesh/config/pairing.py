"""Prefill/decode pairs (``pairing:``): which pair rule splits requests between the
replicas' roles (a replica's ``role``: ``both``, ``prefill``, ``decode``), its options, the
TBT target of a request without a class, the links KV moves over, and the hardware profile
the rule prices decode steps and KV sizes by (docs/routing.md, "Prefill and decode pairs")."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from skymesh.config.base import ConfigModel, Float, Text

PairRuleConfigName = Literal["never", "always", "threshold", "conductor", "elastic"]


class PairingConfig(ConfigModel):
    # never (every request whole), always, threshold (the peers' rule), conductor
    # (Mooncake's Algorithm 1), elastic (the conductor over roles that follow the load):
    # skymesh/routing/pair_registry.py
    rule: PairRuleConfigName = "never"
    # the rule's options by name (threshold_tokens, whole_on_decode, prefill_pool)
    options: dict[str, Any] = Field(default_factory=dict)
    # Mooncake's TBT target: the mean of a request's longest 10% token intervals
    tbt_slo_s: Annotated[Float, Field(gt=0, le=60)] = 0.1
    # the replicas' hardware profile (skymesh/hardware.py) when no replica is a stand-in
    # that names one; the rule prices decode steps and KV bytes per token by it
    profile: Text | None = None
    # the KV links between two replicas of a region
    link_gbps: Annotated[Float, Field(gt=0, le=100_000)] = 100.0
    link_latency_ms: Annotated[Float, Field(ge=0, le=10_000)] = 0.5
