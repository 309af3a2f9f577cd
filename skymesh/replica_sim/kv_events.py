"""vLLM 0.32's KV cache events, as the stand-in emits them: the configuration
(``--kv-events-config``) and the wire structs. Pure (no sockets): the engine builds these
events; :mod:`skymesh.replica_sim.kv_publisher` sends them.

The wire format is vLLM 0.32's (``vllm/distributed/kv_events.py``), reproduced from its
declared layout so msgspec encodes byte for byte what vLLM sends:

* a batch (one per engine step that changed the cache) is a msgpack **array**
  ``[ts, events, data_parallel_rank]`` (the batch struct is ``array_like``; the rank is
  0 for a single engine, set by the publisher, so it is always present);
* each event is a msgpack **map** tagged ``"type"``: ``"BlockStored"``,
  ``"BlockRemoved"`` or ``"AllBlocksCleared"`` (a tagged, not array-like struct with
  ``omit_defaults``: a field that has a default and holds it is left out, a field
  without a default is always written, ``None`` included);
* block hashes are 64-bit unsigned ints (vLLM 0.32 publishes ints by default,
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64 bits of its sha256 block hash).
  The stand-in's are its own xxhash64 chain.

The field order below is the wire order; changing it changes the bytes.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# what vLLM 0.32 reports for the KV cache group of a plain decoder (one group, index 0)
FULL_ATTENTION = "full_attention"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a map whose ``type`` key names the event."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


StandInEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored(block_hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> BlockStored:
    """A BlockStored as vLLM 0.32 fills it for a text-only request of a full-attention
    model on its device pool: no LoRA, ``extra_keys`` one ``None`` per block (vLLM always
    writes the per-block list), group 0, its spec kind, no sliding window or session."""
    return BlockStored(block_hashes=block_hashes, parent_block_hash=parent, token_ids=token_ids,
                       block_size=block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
                       extra_keys=[None] * len(block_hashes), group_idx=0,
                       kv_cache_spec_kind=FULL_ATTENTION)


def removed(block_hash: int) -> BlockRemoved:
    """A BlockRemoved as vLLM 0.32 writes it: one hash per event, group 0."""
    return BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=0)


# ----------------------------------------------------------------------------- config


class KVEventsConfig(BaseModel):
    """``--kv-events-config``: vLLM 0.32's ``KVEventsConfig`` (``vllm/config/kv_events.py``),
    the same keys and defaults, unknown keys refused (vLLM's config dataclasses forbid
    extras)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    # default: "zmq" when events are enabled, else "null"
    publisher: Literal["null", "zmq"] | None = None
    # PUB socket: bound when it holds "*" or "::" or is ipc:// / inproc://, else connected
    endpoint: str = "tcp://*:5557"
    # ROUTER socket for replay requests (always bound); None: no replay
    replay_endpoint: str | None = None
    # batches kept for replay
    buffer_steps: int = 10_000
    # ZMQ high-water mark of the PUB socket
    hwm: int = 100_000
    # batches queued for the publisher thread
    max_queue_size: int = 100_000
    topic: str = ""

    @model_validator(mode="after")
    def _default_publisher(self) -> KVEventsConfig:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        return self

    @property
    def publishes(self) -> bool:
        """Events are built and sent (vLLM: a Null publisher otherwise)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the option's JSON; ValueError with a one-line reason when it is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(object)"
            raise ValueError(f"{where}: {err['msg']}") from None


def binds(endpoint: str) -> bool:
    """vLLM 0.32's rule for the PUB endpoint: bind a wildcard, an IPv6 wildcard or a
    local transport, connect to anything else (a collector that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
