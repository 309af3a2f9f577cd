"""The balancer's subscription to its replicas' vLLM KV events.

vLLM (``--kv-events-config``, publisher "zmq") publishes on a ZMQ PUB socket 3-frame
messages: the topic, an 8-byte big-endian sequence number (0, 1, 2, ... per publisher
process) and a msgpack ``EventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``. Its ROUTER replay socket answers a request holding a start sequence
number with the buffered batches from there (``[topic, seq, payload]`` in vLLM 0.32,
``[seq, payload]`` later), then an end marker (sequence -1, empty payload). Both encodings vLLM has used are read: msgspec structs as arrays (``[ts,
[["BlockStored", hashes, parent, token_ids, block_size, ...], ...]]``) and as maps
(``{"ts": ..., "events": [{"type": "BlockStored", ...}]}``).

Per replica: subscribe; on the first message replay from 0 (the replica may have run
before this balancer: rebuild what its buffer still holds); on a gap replay the missing
batches; a sequence number that goes back means a new publisher (a restarted replica,
with an empty cache): the index starts over. Decoded batches go to the region core
(``kv_events``), which keeps the index the policies read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from skymesh.config import KvEventsEndpoint
from skymesh.routing.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

log = logging.getLogger("skymesh.balancer.kv_events")

END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
_decoder = msgspec.msgpack.Decoder()


class KvEventDecodeError(ValueError):
    """A payload that is not a vLLM EventBatch."""


def _hash(value: Any) -> Any:
    if isinstance(value, (bytes, int, str)) and not isinstance(value, bool):
        return value
    if isinstance(value, list):  # some versions hash as a tuple-like array
        return tuple(_hash(v) for v in value)
    raise KvEventDecodeError(f"a block hash must be bytes or an int, got {type(value).__name__}")


def _hashes(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise KvEventDecodeError("block_hashes must be a list")
    return [_hash(v) for v in value]


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise KvEventDecodeError(f"{what} must be a list of integers")
    return value


def _event(raw: Any) -> KvEvent | None:
    """One event in either encoding; None for an event kind this balancer does not use."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                 "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}.get(kind, ())
        if len(raw) - 1 < len(names):
            raise KvEventDecodeError(f"{kind} with {len(raw) - 1} fields")
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KvEventDecodeError("an event must be a tagged array or a map with a 'type'")
    if kind == "BlockStored":
        size = fields.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise KvEventDecodeError("block_size must be a positive integer")
        parent = fields.get("parent_block_hash")
        return BlockStored(block_hashes=_hashes(fields.get("block_hashes")),
                           parent_block_hash=None if parent is None else _hash(parent),
                           token_ids=_int_list(fields.get("token_ids"), "token_ids"), block_size=size)
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(fields.get("block_hashes")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a newer event kind: ignored, not an error


def decode_batch(payload: bytes) -> list[KvEvent]:
    """The events of one msgpack EventBatch (array or map encoding)."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise KvEventDecodeError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        events = raw.get("events")
    elif isinstance(raw, list) and len(raw) >= 2:
        events = raw[1]
    else:
        raise KvEventDecodeError("an EventBatch must be [ts, events, ...] or {ts, events, ...}")
    if not isinstance(events, list):
        raise KvEventDecodeError("EventBatch.events must be a list")
    out = []
    for e in events:
        ev = _event(e)
        if ev is not None:
            out.append(ev)
    return out


@dataclass
class StreamStats:
    """One replica's event stream, for /admin/status and /metrics."""

    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    unrepaired: int = 0  # batches lost (not in the replica's replay buffer any more)
    restarts: int = 0  # sequence went back: a new publisher
    decode_errors: int = 0
    last_seq: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {"batches": self.batches, "gaps": self.gaps, "replayed": self.replayed,
                "unrepaired": self.unrepaired, "restarts": self.restarts,
                "decode_errors": self.decode_errors, "last_seq": self.last_seq}


Apply = Callable[[str, Sequence[KvEvent], int | None], None]
Reset = Callable[[str], None]


class ReplicaEventStream:
    """One replica's subscription: ordered, gap-repaired batches to ``apply``."""

    def __init__(self, ctx: zmq.asyncio.Context, replica_id: str, ep: KvEventsEndpoint, apply: Apply,
                 reset: Reset) -> None:
        self.ctx, self.replica_id, self.ep = ctx, replica_id, ep
        self.apply, self.reset = apply, reset
        self.stats = StreamStats()

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.ep.topic.encode())
        sub.connect(self.ep.endpoint)  # zmq reconnects by itself when the replica restarts
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats.decode_errors += 1
                    continue
                await self._on_message(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            sub.close(linger=0)

    async def _on_message(self, seq: int, payload: bytes) -> None:
        last = self.stats.last_seq
        if last is None:
            # the first message: rebuild what the replica's replay buffer still holds
            await self._replay(0, seq)
        elif seq <= last:
            # the sequence went back: a new publisher process, an empty cache
            self.stats.restarts += 1
            self.reset(self.replica_id)
            log.info("kv event stream restarted", extra={"replica": self.replica_id, "seq": seq})
            if seq > 0:
                await self._replay(0, seq)
        elif seq > last + 1:
            self.stats.gaps += 1
            await self._replay(last + 1, seq)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except KvEventDecodeError as e:
            self.stats.decode_errors += 1
            log.warning("undecodable kv event batch", extra={"replica": self.replica_id, "seq": seq,
                                                              "error": str(e)})
            events = []
        self.stats.last_seq = seq
        self.stats.batches += 1
        self.apply(self.replica_id, events, self.ep.max_blocks)

    async def _replay(self, start: int, until: int) -> None:
        """Apply batches [start, until) from the replica's replay buffer, in order."""
        if until <= start:
            return
        if self.ep.replay_endpoint is None:
            self.stats.unrepaired += until - start
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.ep.replay_endpoint)
        got = start
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    frames = await sock.recv_multipart()
                reply = _replay_reply(frames)
                if reply is None:
                    self.stats.decode_errors += 1
                    continue
                seq, payload = reply
                if seq == END_SEQ:
                    break
                if start <= seq < until and seq >= got:
                    if seq > got:
                        self.stats.unrepaired += seq - got  # older than the buffer holds
                    self._apply(seq, payload)
                    self.stats.replayed += 1
                    got = seq + 1
        except TimeoutError:
            log.warning("kv event replay timed out", extra={"replica": self.replica_id, "from": start})
        finally:
            sock.close(linger=0)
        if got < until:
            self.stats.unrepaired += until - got


def _replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay answer as a DEALER receives it: the empty delimiter,
    then [topic, seq, payload] (vLLM 0.32) or [seq, payload] (later versions); the end
    marker carries seq -1."""
    if not frames or frames[0] != b"":
        return None
    rest = frames[1:]
    if len(rest) == 3:
        rest = rest[1:]  # the topic
    if len(rest) != 2 or len(rest[0]) != 8:
        return None
    return int.from_bytes(rest[0], "big", signed=True), rest[1]


class KvEventSubscriber:
    """The event streams of every replica this balancer owns that publishes events."""

    def __init__(self, apply: Apply, reset: Reset) -> None:
        self.ctx = zmq.asyncio.Context()
        self.apply, self.reset = apply, reset
        self.streams: dict[str, ReplicaEventStream] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def set_replicas(self, endpoints: dict[str, KvEventsEndpoint]) -> None:
        """Follow membership: subscribe to new publishers, drop those that left or moved."""
        for rid in list(self.streams):
            if rid not in endpoints or endpoints[rid] != self.streams[rid].ep:
                self._tasks.pop(rid).cancel()
                del self.streams[rid]
        for rid, ep in endpoints.items():
            if rid not in self.streams:
                stream = self.streams[rid] = ReplicaEventStream(self.ctx, rid, ep, self.apply, self.reset)
                self._tasks[rid] = asyncio.get_running_loop().create_task(self._supervise(stream))

    async def _supervise(self, stream: ReplicaEventStream) -> None:
        backoff = 0.1
        while True:
            try:
                await stream.run()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: logged, the stream restarted (its index keeps its state)
                log.exception("kv event stream failed", extra={"replica": stream.replica_id})
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self.streams.clear()
        self.ctx.destroy(linger=0)

    def status(self) -> dict[str, dict[str, Any]]:
        return {rid: s.stats.as_json() for rid, s in self.streams.items()}
