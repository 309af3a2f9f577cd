"""One replica of a region: a real vLLM server's URL or a stand-in (``sim:``), and where it
publishes vLLM's KV events (a stand-in's endpoint follows from its ``sim.kv_events``)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from skymesh.config.base import ConfigError, ConfigModel, Int, Text, matching, set_derived
from skymesh.config.network import DerivedHttpUrl
from skymesh.config.sim import SimReplica
from skymesh.hardware import PROFILES

REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


ReplicaId = Annotated[
    Text,
    AfterValidator(matching(REPLICA_ID_RE, "letters, digits, '.', '_' or '-'")),
    Field(json_schema_extra={"pattern": REPLICA_ID_RE.pattern}),
]


class KvEventsEndpoint(ConfigModel):
    """Where a replica publishes vLLM's KV events (its ``--kv-events-config``): the
    balancer subscribes and keeps the replica's exact cache state (skymesh/routing/kv_index.py)."""

    # the replica's ZMQ PUB socket, e.g. tcp://10.0.0.5:5557
    endpoint: Annotated[Text, Field(pattern=r"^tcp://[^\s/]+:\d{1,5}$")]
    # its replay ROUTER socket (missed batches by sequence number); None: gaps stay gaps
    replay_endpoint: Annotated[Text, Field(pattern=r"^tcp://[^\s/]+:\d{1,5}$")] | None = None
    topic: str = ""
    # the index's bound in blocks (the replica's KV capacity, vllm:cache_config_info's
    # num_gpu_blocks); past it the least recently stored blocks are dropped
    max_blocks: Annotated[Int, Field(ge=1, le=1 << 24)] = 200_000


def _sim_kv_events(sim: SimReplica) -> KvEventsEndpoint:
    """Where a balancer subscribes to a publishing stand-in; the index bound is its KV
    capacity (the profile's blocks)."""
    kv = sim.kv_events
    assert kv is not None
    host = f"[{sim.host}]" if ":" in sim.host else sim.host
    profile = PROFILES.get(sim.profile)
    return KvEventsEndpoint(
        endpoint=f"tcp://{host}:{kv.port}",
        replay_endpoint=None if kv.replay_port is None else f"tcp://{host}:{kv.replay_port}",
        topic=kv.topic,
        **({"max_blocks": profile.num_gpu_blocks} if profile is not None else {}))


class ReplicaConfig(ConfigModel):
    id: ReplicaId
    # base URL of the OpenAI-compatible server; for a sim replica derived from sim.host/port
    url: DerivedHttpUrl = Field(default=None, description="exactly one of url or sim")
    sim: SimReplica | None = None
    # the replica's KV-event publisher (optional): exact cache state instead of the
    # balancer's routing history
    kv_events: KvEventsEndpoint | None = None
    # prefill/decode role (docs/routing.md, "Prefill and decode pairs"): both serves whole
    # requests; prefill and decode take their legs of split ones (``pairing:``)
    role: Literal["both", "prefill", "decode"] = "both"

    @model_validator(mode="after")
    def _url_or_sim(self) -> ReplicaConfig:
        if (self.url is None) == (self.sim is None):
            raise ConfigError("", "exactly one of 'url' (a real vLLM server) or 'sim' is required")
        if self.sim is not None:
            set_derived(self, "url", f"http://{self.sim.host}:{self.sim.port}")
            if self.sim.kv_events is not None:
                if self.kv_events is not None:
                    raise ConfigError("kv_events", "a sim replica's kv_events follow from sim.kv_events; "
                                                   "set only that")
                set_derived(self, "kv_events", _sim_kv_events(self.sim))
        return self
