"""Exact cache state from vLLM's KV events: decoding both encodings, the per-replica block
index keyed by skymesh's own hash of token ids, the policy reading it through CacheView,
and a live balancer subscribed to a publisher speaking vLLM's wire protocol (PUB frames
topic / 8-byte sequence / msgpack batch, ROUTER replay ending in sequence -1), with a
gap replayed and a publisher restart."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from skymesh.balancer.kv_events import KvEventDecodeError, decode_batch
from skymesh.balancer.server import Balancer
from skymesh.config import parse_config
from skymesh.prompt_encoder import PromptEncoder, id_chunk_hashes
from skymesh.routing.kv_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvIndexes,
    ReplicaBlockIndex,
)
from skymesh.routing.model import RegionModel
from skymesh.runtime.procs import free_port
from tests.mesh_helpers import one_region_config
from tests.test_balancer_faults import FakeReplica
from tests.test_prompt_tokens import tokenizer_dir  # noqa: F401 - the fixture

BLOCK = 16


# vLLM's event structs, in both encodings it has used (msgspec, tagged by class name)
class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class AStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ARemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None


class ACleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MStored(MapEvent, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    group_idx: int | None = None


class MRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None


_enc = msgspec.msgpack.Encoder()


def stored_events(ids: list[int], vllm_hash: Any, parent: Any = None, array: bool = True) -> list[Any]:
    """One BlockStored per full block of ``ids``; vLLM hashes ``vllm_hash(k)``."""
    n = len(ids) // BLOCK
    hashes = [vllm_hash(k) for k in range(n)]
    cls = AStored if array else MStored
    return [cls(block_hashes=hashes, parent_block_hash=parent, token_ids=ids[: n * BLOCK], block_size=BLOCK,
                lora_id=None, medium="GPU")]


def batch(events: list[Any], array: bool = True) -> bytes:
    return _enc.encode((ArrayBatch if array else MapBatch)(ts=time.time(), events=events))


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("array", [True, False])
def test_both_encodings_decode_to_the_same_events(array: bool) -> None:
    ids = list(range(40))
    rm = ARemoved(block_hashes=[b"h1"], medium="GPU") if array else MRemoved(block_hashes=[b"h1"], medium="GPU")
    events = stored_events(ids, lambda k: bytes([k]) * 32, array=array) + [rm]
    if array:
        events.append(ACleared())
    out = decode_batch(batch(events, array))
    assert isinstance(out[0], BlockStored)
    assert out[0].block_hashes == [bytes([0]) * 32, bytes([1]) * 32] and out[0].token_ids == ids[:32]
    assert out[0].parent_block_hash is None and out[0].block_size == BLOCK
    assert isinstance(out[1], BlockRemoved) and out[1].block_hashes == [b"h1"]
    if array:
        assert isinstance(out[2], AllBlocksCleared)


def test_vllm_0_32s_mix_decodes_an_array_batch_of_map_events_with_int_hashes() -> None:
    """vLLM 0.32: the batch is array-like, its events are maps tagged "type", and block
    hashes are published as ints (the digest's low 64 bits) by default."""
    ev = MStored(block_hashes=[2**63 + 5, 7], parent_block_hash=None, token_ids=list(range(32)), block_size=BLOCK,
                 lora_id=None, medium="GPU", group_idx=0)
    payload = _enc.encode(ArrayBatch(ts=1.0, events=[ev, MRemoved(block_hashes=[7], medium="GPU")],
                                     data_parallel_rank=0))
    stored, removed = decode_batch(payload)
    assert isinstance(stored, BlockStored) and stored.block_hashes == [2**63 + 5, 7]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [7]


def test_bad_payloads_are_refused_and_unknown_kinds_skipped() -> None:
    for payload in (b"\xc1", _enc.encode(5), _enc.encode([1.0, 3]), _enc.encode({"ts": 1, "events": [7]}),
                    _enc.encode([1.0, [["BlockStored", [b"x"], None, ["a"], 16]]]),
                    _enc.encode([1.0, [["BlockStored", [b"x"], None, [1], 0]]])):
        with pytest.raises(KvEventDecodeError):
            decode_batch(payload)
    assert decode_batch(_enc.encode([1.0, [["SomethingNew", 1, 2]]])) == []


# ----------------------------------------------------------------------------- the index


def test_the_index_keys_blocks_by_our_hash_of_their_token_ids() -> None:
    prompt = list(range(100, 100 + 5 * BLOCK + 3))  # 5 full blocks and a partial one
    chunks = id_chunk_hashes(prompt, BLOCK)
    idx = ReplicaBlockIndex(BLOCK, max_blocks=100)
    # stored in two events, the second naming the first's last block as parent (vLLM's
    # hashes are opaque bytes here: nothing of ours depends on them)
    idx.apply(decode_batch(batch(stored_events(prompt[: 2 * BLOCK], lambda k: f"a{k}".encode()))), 1.0)
    idx.apply(decode_batch(batch(stored_events(prompt[2 * BLOCK : 5 * BLOCK], lambda k: f"b{k}".encode(),
                                               parent=b"a1"))), 2.0)
    assert idx.cached_chunks(chunks) == 5
    other = id_chunk_hashes([7] + prompt[1:], BLOCK)
    assert idx.cached_chunks(other) == 0  # a different first token changes every block
    idx.apply([BlockRemoved([b"b1"])], 3.0)  # the 4th block evicted
    assert idx.cached_chunks(chunks) == 3
    idx.apply([BlockStored([b"c0"], b"unknown-parent", prompt[:BLOCK], BLOCK)], 4.0)
    assert idx.orphans == 1  # a parent never seen: cannot be keyed, not guessed
    idx.apply([AllBlocksCleared()], 5.0)
    assert idx.cached_chunks(chunks) == 0 and len(idx) == 0
    # bounded: past max_blocks the least recently stored go first
    small = ReplicaBlockIndex(BLOCK, max_blocks=3)
    small.apply(decode_batch(batch(stored_events(prompt, lambda k: f"d{k}".encode()))), 6.0)
    assert len(small) == 3 and small.evicted_by_bound == 2
    assert small.cached_chunks(chunks) == 0  # its first blocks went: no prefix is whole


def test_the_cache_view_reads_events_where_live_and_the_trie_elsewhere() -> None:
    prompt = list(range(3 * BLOCK))
    chunks = id_chunk_hashes(prompt, BLOCK)
    indexes = KvIndexes(chunk_tokens=BLOCK)
    view = RegionModel(chunk_tokens=BLOCK, trie_max_nodes=1000, kv_indexes=indexes).cache
    view.insert(chunks, "r1")  # the balancer sent it to r1 ...
    view.insert(chunks, "r2")
    assert view.match_per_target(chunks, ["r1", "r2"]) == {"r1": 3, "r2": 3}
    # ... but r1's events say it evicted the last block, and r2 publishes nothing
    r1 = indexes.index("r1")
    r1.apply(decode_batch(batch(stored_events(prompt[: 2 * BLOCK], lambda k: f"x{k}".encode()))), 1.0)
    r1.in_step = True
    assert view.match_per_target(chunks, ["r1", "r2"]) == {"r1": 2, "r2": 3}
    assert view.longest_match(chunks, ["r1", "r2"]) == (3, {"r2"})
    assert indexes.source_of("r1") == "events" and indexes.source_of("r2") == "routing-history"
    assert view.source_names(["r1", "r2"]) == {"r1": "events", "r2": "routing-history"}
    # an index whose blocks are not our chunks is not used
    r1.block_size = 128
    assert view.match_per_target(chunks, ["r1"]) == {"r1": 3}


# ----------------------------------------------------------------------------- live


class FakeVllmPublisher:
    """vLLM's ZMQ publisher protocol (PUB + ROUTER replay with a buffer), driven by the test."""

    def __init__(self, topic: str = "kv", replay_with_topic: bool = True) -> None:
        # vLLM 0.32 answers a replay with [topic, seq, payload], later versions [seq, payload]
        self.replay_with_topic = replay_with_topic
        self.ctx = zmq.asyncio.Context()
        self.topic = topic.encode()
        self.pub_port, self.replay_port = free_port(), free_port()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=1000)
        self.seq = 0
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.replays = 0
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, payload: bytes, *, drop: bool = False) -> None:
        """One batch; ``drop``: lost on the PUB socket (kept for replay), a gap."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        """A new publisher process: sequence from 0, empty buffer."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            head = [client, b""] + ([self.topic] if self.replay_with_topic else [])
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = [client, b""] + ([b""] if self.replay_with_topic else [])
            await self.router.send_multipart([*end, (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.destroy(linger=0)


async def until(cond: Any, what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {within_s} s: {what}")


@contextlib.asynccontextmanager
async def balancer_with_events(tokenizer: Path, replay_with_topic: bool
                               ) -> AsyncIterator[tuple[Balancer, list[FakeReplica], FakeVllmPublisher]]:
    fakes = [FakeReplica(f"r{i}") for i in range(3)]
    for f in fakes:
        await f.start()
    pub = FakeVllmPublisher(replay_with_topic=replay_with_topic)
    data = one_region_config({f.name: f.url for f in fakes}, free_port(), free_port(), name="prefix_tree",
                             probe_interval_s=0.05, chunk_tokens=BLOCK)
    data["tokenizer"] = {"path": str(tokenizer)}
    # only r2 publishes events
    data["regions"][0]["replicas"][2]["kv_events"] = {
        "endpoint": f"tcp://127.0.0.1:{pub.pub_port}", "replay_endpoint": f"tcp://127.0.0.1:{pub.replay_port}",
        "topic": "kv"}
    b = Balancer(parse_config(data), "us-east-1")
    await b.start(port=0)
    try:
        await until(lambda: all(v.healthy for v in b.core.view.replicas.values()), "replicas healthy")
        yield b, fakes, pub
    finally:
        await b.stop()
        await pub.close()
        for f in fakes:
            await f.stop()


@pytest.mark.parametrize("replay_with_topic", [True, False], ids=["vllm-0.32-replay", "later-replay"])
async def test_the_balancer_routes_on_the_replicas_events_with_gaps_replayed_and_restarts(
    tokenizer_dir: Path, replay_with_topic: bool,  # noqa: F811 - the fixture
) -> None:
    tok = tokenizer_dir / "tokenizer.json"
    enc = PromptEncoder.from_files(BLOCK, tok)
    prompt = "吾輩は猫である。名前はまだ無い。" * 30
    ids = enc.tokenizer.encode(prompt).ids
    assert len(ids) >= 4 * BLOCK
    async with balancer_with_events(tok, replay_with_topic) as (b, fakes, pub):
        stream = lambda: b.kv_subscriber.streams["r2"].stats  # noqa: E731
        # a batch about something else first (lost to the slow joiner or not: the first
        # message received triggers a replay from 0 either way)
        warm = list(range(3000, 3000 + BLOCK))
        for _ in range(50):
            await pub.publish(batch(stored_events(warm, lambda k: f"w{k}".encode())))
            if stream().batches:
                break
            await asyncio.sleep(0.05)
        await until(lambda: stream().batches >= 1, "the first batch")
        # r2 computed the prompt (another router sent it there): the event arrives in a
        # gap (lost on PUB), the next batch reveals the gap and replay fills it
        await pub.publish(batch(stored_events(ids, lambda k: f"p{k}".encode())), drop=True)
        await pub.publish(batch([]))
        await until(lambda: stream().gaps == 1 and stream().replayed >= 1, "the gap replayed")
        assert b.admin_status()["replicas"]["r2"]["cache_source"] == "events"
        assert b.admin_status()["replicas"]["r0"]["cache_source"] == "routing-history"
        body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": 4}
        url = f"http://127.0.0.1:{b.bound_port}/v1/completions"
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=body) as r:
                assert r.status == 200 and r.headers["X-Skymesh-Replica"] == "r2"
            # r2 restarts (sequence back to 0, empty cache); the balancer's own history says
            # r2 holds the prompt, but r2's events rule for r2: nothing is cached there now
            pub.restart()
            await pub.publish(batch(stored_events(warm, lambda k: f"v{k}".encode())))
            await until(lambda: stream().restarts == 1, "the restart seen")
            idx = b.core.kv_indexes.by_replica["r2"]
            assert idx.cached_chunks(enc.encode_text(prompt).chunk_hashes) == 0
        st = b.admin_status()["kv_events"]["r2"]
        assert st["stream"]["gaps"] == 1 and st["stream"]["restarts"] == 1 and st["index"]["blocks"] >= 1
