"""The stand-in speaks vLLM 0.32's KV events: a ZMQ subscriber decodes its messages with
vLLM 0.32's own struct layout (declared below, independently of skymesh's), stored events
carry a prompt's full blocks with the tokenizer's ids (which the balancer hashes to the
same chunk keys), eviction is a BlockRemoved, a reset an AllBlocksCleared, the replay
socket answers from a sequence number and ends with -1, sequence numbers run from 0
without a gap, and nothing is published unless asked for."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq

from skymesh.assets.bpe import train_byte_bpe
from skymesh.config import ConfigError, parse_config
from skymesh.hardware import PROFILES
from skymesh.prompt_encoder import PromptEncoder
from skymesh.replica_sim.block_pool import chained_block_hashes
from skymesh.replica_sim.engine import Engine
from skymesh.replica_sim.kv_events import KVEventBatch as StandInBatch
from skymesh.replica_sim.kv_events import KVEventsConfig
from skymesh.replica_sim.kv_publisher import NullPublisher, ZmqPublisher
from skymesh.replica_sim.server import ReplicaServer, start_replica
from skymesh.routing import kv_index
from skymesh.runtime.procs import Child
from skymesh.word_tokenizer import filler_tokens, word_token_id
from tests.mesh_helpers import one_region_config

BS = 16
MODEL = "skymesh-sim"
# probe requests sent until a subscriber is known to be in (a count, not a time limit)
MAX_PROBES = 500


# ----------------------------------------------------------------------------- vLLM 0.32's wire structs
# As declared in vllm/distributed/kv_events.py of vLLM 0.32.0: the batch is array-like,
# the events are tagged maps (tag = class name, key "type"), defaults omitted.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Message = tuple[bytes, int, bytes]  # topic, seq, payload


def decode(payload: bytes) -> KVEventBatch:
    return DECODER.decode(payload)


# ----------------------------------------------------------------------------- a subscriber


class Subscriber:
    """A ZMQ SUB socket read by a thread (a SUB that binds only takes in a publisher that
    connects while someone reads it, so the thread reads from the start)."""

    def __init__(self, *, bind: bool, endpoint: str = "tcp://127.0.0.1", topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.subscribe(topic)
        if bind:
            port = self.sock.bind_to_random_port(endpoint)
            self.endpoint = f"{endpoint}:{port}"
        else:
            self.sock.connect(endpoint)
            self.endpoint = endpoint
        self.messages: list[Message] = []
        self._arrived = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                topic, seq, payload = self.sock.recv_multipart()
                with self._arrived:
                    self.messages.append((topic, int.from_bytes(seq, "big"), payload))
                    self._arrived.notify_all()

    def wait_until(self, cond: Callable[[], bool]) -> None:
        """Block until ``cond()`` holds, checked at each message (no time limit)."""
        with self._arrived:
            self._arrived.wait_for(cond)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.ctx.term()

    def batches(self, start: int = 0) -> list[KVEventBatch]:
        return [decode(p) for _, _, p in self.messages[start:]]


def replay(endpoint: str, start_seq: int) -> tuple[list[Message], list[bytes]]:
    """vLLM's replay request from a DEALER ([b"", start_seq as 8 bytes big-endian]);
    returns the batches answered and the final frame."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[Message] = []
        while True:
            frames = sock.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4, frames
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                return out, frames[1:]
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
        ctx.term()


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer trained here (nothing is downloaded)."""
    d = tmp_path_factory.mktemp("tok")
    corpus = ["The quick brown fox jumps over the lazy dog near the river bank.",
              "A load balancer keeps the cache warm by sending shared prefixes to one replica.",
              "Prefix caching stores the key and value tensors of every full block."] * 30
    path = d / "tokenizer.json"
    train_byte_bpe(corpus, 400, special_tokens=["<s>", "</s>"]).save(str(path))
    return path


def events_config(sub: Subscriber | None = None, **kw: Any) -> KVEventsConfig:
    data: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq"}
    if sub is not None:
        data["endpoint"] = sub.endpoint  # a host endpoint: the stand-in connects, as vLLM does
    data.update(kw)
    return KVEventsConfig.model_validate(data)


@contextlib.asynccontextmanager
async def publishing_replica(tmp_path: Path, tokenizer: Path | None = None, **kw: Any,
                             ) -> AsyncIterator[tuple[ReplicaServer, Subscriber]]:
    sub = Subscriber(bind=True)
    replay_ep = kw.pop("replay_endpoint", f"ipc://{tmp_path}/replay.sock")
    cfg = events_config(sub, replay_endpoint=replay_ep, **kw.pop("events", {}))
    srv: ReplicaServer | None = None
    try:
        srv = await start_replica(profile="tiny-test", time_scale=0.01, tokenizer=tokenizer, kv_events=cfg, **kw)
        yield srv, sub
    finally:
        if srv is not None:
            await srv.close()
        sub.close()


async def complete(s: aiohttp.ClientSession, url: str, prompt: Any, max_tokens: int) -> dict[str, Any]:
    async with s.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                     "max_tokens": max_tokens}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def subscribed(s: aiohttp.ClientSession, srv: ReplicaServer, sub: Subscriber) -> int:
    """Send one-block probe prompts until the subscriber has received a batch (a PUB drops
    what it sends before the subscription reaches it); from then on nothing is missed.
    Returns how many messages precede what follows."""
    k = 0
    while not sub.messages:
        await complete(s, srv.url, [10_000_000 + 100 * k + i for i in range(BS)], 1)
        k += 1
        assert k < MAX_PROBES, "no batch reached the subscriber"
        await asyncio.sleep(0.01)
    await wait_for(sub, lambda: sub.messages[-1][1] == publisher_of(srv).next_seq - 1)
    return len(sub.messages)


async def wait_for(sub: Subscriber, cond: Callable[[], bool]) -> None:
    await asyncio.to_thread(sub.wait_until, cond)


def publisher_of(srv: ReplicaServer) -> ZmqPublisher:
    assert isinstance(srv.engine_loop.kv_publisher, ZmqPublisher)
    return srv.engine_loop.kv_publisher


def stored_events(batches: list[KVEventBatch]) -> list[BlockStored]:
    return [ev for b in batches for ev in b.events if isinstance(ev, BlockStored)]


# ----------------------------------------------------------------------------- the encoding


def test_a_batch_is_byte_for_byte_what_vllm_032_encodes() -> None:
    """The stand-in's structs encode exactly as vLLM 0.32's: decoding with vLLM's layout
    and encoding again gives the same bytes; the batch is an array, each event a map."""
    e = Engine(PROFILES["tiny-test"], num_gpu_blocks=4)
    e.enable_kv_events()
    ids = list(range(100, 100 + 2 * BS + 3))
    tokens = [str(i) for i in ids]
    e.add_request("a", len(ids), chained_block_hashes(tokens, BS), 1, 0.0, token_ids=ids)
    e.step(0.0)
    events = e.take_kv_events()
    payload = msgspec.msgpack.encode(StandInBatch(ts=12.5, events=events, data_parallel_rank=0))
    batch = decode(payload)
    assert msgspec.msgpack.encode(batch) == payload
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and raw[0] == 12.5 and raw[2] == 0  # [ts, events, dp rank]
    (ev,) = raw[1]
    assert list(ev) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
    assert ev["type"] == "BlockStored" and ev["parent_block_hash"] is None and ev["lora_id"] is None
    assert ev["token_ids"] == ids[: 2 * BS] and ev["block_size"] == BS and ev["medium"] == "GPU"
    assert ev["extra_keys"] == [None, None] and ev["group_idx"] == 0
    assert ev["kv_cache_spec_kind"] == "full_attention"
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in ev["block_hashes"])


def test_engine_records_stored_removed_and_cleared() -> None:
    e = Engine(PROFILES["tiny-test"], num_gpu_blocks=8)
    e.enable_kv_events()

    def add(rid: str, ids: list[int], max_tokens: int) -> list[int]:
        seq = [str(i) for i in ids] + filler_tokens(max_tokens)
        hashes = chained_block_hashes(seq, BS)
        e.add_request(rid, len(ids), hashes, max_tokens, 0.0, token_ids=[word_token_id(w) for w in seq])
        return hashes

    a = add("a", list(range(20)), 14)  # 20 + 14 - 1 = 33 tokens computed: 2 blocks
    t = 0.0
    events: list[Any] = []
    while e.has_work():
        t += e.step(t).duration_s
        events += e.take_kv_events()
    first, second = events  # the prompt's block at prefill, the mixed block in decode
    assert first.block_hashes == a[:1] and first.parent_block_hash is None and first.token_ids == list(range(16))
    assert second.block_hashes == a[1:2] and second.parent_block_hash == a[0]
    assert second.token_ids == [16, 17, 18, 19] + [word_token_id(f"tok{i}") for i in range(12)]
    assert e.reset_prefix_cache()
    assert [type(ev).__name__ for ev in e.take_kv_events()] == ["AllBlocksCleared"]
    add("b", list(range(40)), 30)  # holds blocks: no reset while it runs
    e.step(0.0)
    e.take_kv_events()
    assert not e.reset_prefix_cache() and e.take_kv_events() == []
    e.drop_all_requests()  # the engine restarted after a crash: the cache is gone
    assert [type(ev).__name__ for ev in e.take_kv_events()] == ["AllBlocksCleared"]


def test_config_is_vllms_kv_events_config() -> None:
    off = KVEventsConfig.from_json("{}")
    assert (off.enable_kv_cache_events, off.publisher, off.endpoint, off.replay_endpoint) == \
        (False, "null", "tcp://*:5557", None)
    assert (off.buffer_steps, off.hwm, off.max_queue_size, off.topic) == (10_000, 100_000, 100_000, "")
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert not KVEventsConfig.from_json('{"publisher": "zmq"}').publishes  # vLLM: disabled wins
    with pytest.raises(ValueError, match="endpont"):
        KVEventsConfig.from_json('{"endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.from_json('{"publisher": "kafka"}')


async def test_publisher_is_off_by_default() -> None:
    for kv_events in (None, KVEventsConfig(), events_config(publisher="null"),
                      KVEventsConfig(publisher="zmq")):
        srv = await start_replica(profile="tiny-test", time_scale=0.01, kv_events=kv_events)
        try:
            assert isinstance(srv.engine_loop.kv_publisher, NullPublisher) and srv.engine.kv_events is None
            async with aiohttp.ClientSession() as s:
                await complete(s, srv.url, " ".join(f"w{i}" for i in range(40)), 2)
            assert srv.engine.take_kv_events() == []
        finally:
            await srv.close()


# ----------------------------------------------------------------------------- over ZMQ


async def test_stored_events_carry_the_tokenizers_ids_and_match_the_balancers_chunks(
        tmp_path: Path, tokenizer_path: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    prompt = ("The quick brown fox jumps over the lazy dog near the river bank. " * 8).strip()
    ids = tok.encode(prompt).ids
    full = len(ids) // BS
    assert full >= 3 and len(ids) % BS  # a partial last block, never stored
    async with publishing_replica(tmp_path, tokenizer=tokenizer_path) as (srv, sub), aiohttp.ClientSession() as s:
        start = await subscribed(s, srv, sub)
        out = await complete(s, srv.url, prompt, 1)
        assert out["usage"]["prompt_tokens"] == len(ids)
        await wait_for(sub, lambda: len(sub.messages) > start)
        (ev,) = stored_events(sub.batches(start))  # P + 1 - 1 tokens computed: the full blocks
    assert ev.token_ids == ids[: full * BS] and ev.block_size == BS and len(ev.block_hashes) == full
    assert ev.parent_block_hash is None and ev.medium == "GPU"
    # the balancer's keys for this prompt, from the same tokenizer, are the event's blocks
    ours = PromptEncoder.from_files(BS, tokenizer_path).encode_text(prompt).chunk_hashes
    parent = 0
    for k in range(full):
        parent = kv_index.block_hash(ev.token_ids[k * BS:(k + 1) * BS], parent)
        assert parent == ours[k]
    idx = kv_index.ReplicaBlockIndex(BS, 1000)
    idx.apply([kv_index.BlockStored(list(ev.block_hashes), ev.parent_block_hash, ev.token_ids, ev.block_size)], 0.0)
    assert idx.cached_chunks(ours) == full


async def test_generated_blocks_are_stored_chained_to_the_prompt(tmp_path: Path) -> None:
    """Without a tokenizer a token-id prompt keeps its ids; output blocks follow, each
    chained to the block before it."""
    ids = list(range(5000, 5000 + BS + 4))
    async with publishing_replica(tmp_path) as (srv, sub), aiohttp.ClientSession() as s:
        start = await subscribed(s, srv, sub)
        await complete(s, srv.url, ids, 2 * BS)  # 20 + 32 - 1 = 51 tokens: 3 full blocks
        await wait_for(sub, lambda: len(stored_events(sub.batches(start))) >= 3)
        evs = stored_events(sub.batches(start))
    assert len(evs) == 3 and [len(ev.block_hashes) for ev in evs] == [1, 1, 1]
    assert evs[0].token_ids == ids[:BS] and evs[0].parent_block_hash is None
    assert evs[1].token_ids[:4] == ids[BS:] and evs[1].parent_block_hash == evs[0].block_hashes[0]
    assert evs[2].parent_block_hash == evs[1].block_hashes[0]


async def test_eviction_is_a_block_removed(tmp_path: Path) -> None:
    a_ids = list(range(2 * BS))

    def a_and_removed(batches: list[KVEventBatch]) -> tuple[BlockStored | None, list[BlockRemoved]]:
        a = next((ev for ev in stored_events(batches) if ev.token_ids == a_ids), None)
        return a, [ev for b in batches for ev in b.events if isinstance(ev, BlockRemoved)]

    def a_evicted(start: int) -> bool:
        a, removed = a_and_removed(sub.batches(start))
        return a is not None and set(a.block_hashes) <= {h for ev in removed for h in ev.block_hashes}

    async with publishing_replica(tmp_path, num_gpu_blocks=4) as (srv, sub), aiohttp.ClientSession() as s:
        start = await subscribed(s, srv, sub)
        await complete(s, srv.url, a_ids, 1)  # stores 2 blocks, held by nobody once done
        await complete(s, srv.url, list(range(1000, 1000 + 3 * BS)), 1)  # needs all 4 blocks
        await wait_for(sub, lambda: a_evicted(start))
        a, removed = a_and_removed(sub.batches(start))
    assert a is not None and len(a.block_hashes) == 2
    assert removed and all(len(ev.block_hashes) == 1 and ev.medium == "GPU" and ev.group_idx == 0
                           for ev in removed)


async def test_replay_from_a_seq_and_contiguous_sequence_numbers(tmp_path: Path) -> None:
    async with publishing_replica(tmp_path, replay_endpoint="tcp://*:0", events={"topic": "kv@r1"}) as (srv, sub), \
            aiohttp.ClientSession() as s:
        start = await subscribed(s, srv, sub)
        for k in range(4):
            await complete(s, srv.url, [20_000 + 100 * k + i for i in range(BS)], 1)
        await wait_for(sub, lambda: len(sub.messages) >= start + 4)
        ep = srv.engine_loop.kv_publisher.replay_endpoint
        assert ep is not None and ep.startswith("tcp://127.0.0.1:")  # *:0 -> a free port on --host
        live = list(sub.messages)
        all_of_them, end = await asyncio.to_thread(replay, ep, 0)
        from_3, _ = await asyncio.to_thread(replay, ep, 3)
        past, end_past = await asyncio.to_thread(replay, ep, 1 << 40)
    seqs = [seq for _, seq, _ in all_of_them]
    assert seqs == list(range(len(seqs))) and len(seqs) >= start + 4  # from 0, no gap
    assert [seq for _, seq, _ in live] == list(range(live[0][1], live[0][1] + len(live)))
    assert {seq: p for _, seq, p in live}.items() <= {seq: p for _, seq, p in all_of_them}.items()
    assert all(t == b"kv@r1" for t, _, _ in all_of_them + live)
    assert from_3 == all_of_them[3:]
    assert past == [] and end == end_past == [b"", END_SEQ, b""]
    assert int.from_bytes(end[1], "big", signed=True) == -1


class _LatePublisher(ZmqPublisher):
    """A publisher whose thread starts its loop only when told: what a loaded machine does
    when the thread is scheduled late (a batch and a replay request wait for it together)."""

    def __init__(self, cfg: KVEventsConfig) -> None:
        self.go = threading.Event()
        super().__init__(cfg)

    def _run(self) -> None:
        self.go.wait()
        super()._run()


@pytest.mark.fault
async def test_a_replay_answers_a_batch_published_before_it_even_when_the_thread_wakes_late(
        tmp_path: Path) -> None:
    from skymesh.replica_sim.kv_events import AllBlocksCleared

    pub = _LatePublisher(events_config(endpoint=f"ipc://{tmp_path}/pub.sock",
                                       replay_endpoint=f"ipc://{tmp_path}/replay.sock"))
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        pub.publish([AllBlocksCleared()])  # batch 0: queued, not sent (the thread waits)
        assert pub.replay_endpoint is not None and pub._replay is not None
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        # the thread is parked before its loop: this one may read the socket meanwhile
        assert pub._replay.poll() == zmq.POLLIN  # the request is there, beside the batch
        pub.go.set()
        frames = await asyncio.to_thread(dealer.recv_multipart)
        # batch 0 first (the old loop served the request first: only the end marker)
        assert frames[2:3] == [(0).to_bytes(8, "big")], frames
        assert (await asyncio.to_thread(dealer.recv_multipart))[2] == END_SEQ
    finally:
        pub.go.set()
        dealer.close(linger=0)
        ctx.term()
        await asyncio.to_thread(pub.close)


async def test_replay_keeps_the_last_buffer_steps_batches(tmp_path: Path) -> None:
    async with publishing_replica(tmp_path, events={"buffer_steps": 2}) as (srv, sub), aiohttp.ClientSession() as s:
        await subscribed(s, srv, sub)
        for k in range(3):
            await complete(s, srv.url, [30_000 + 100 * k + i for i in range(BS)], 1)
        last = publisher_of(srv).next_seq - 1
        await wait_for(sub, lambda: sub.messages[-1][1] == last)
        got, _ = await asyncio.to_thread(replay, f"ipc://{tmp_path}/replay.sock", 0)
    assert [seq for _, seq, _ in got] == [last - 1, last]


async def test_reset_prefix_cache_goes_out_as_all_blocks_cleared(tmp_path: Path) -> None:
    async with publishing_replica(tmp_path) as (srv, sub), aiohttp.ClientSession() as s:
        start = await subscribed(s, srv, sub)
        async with s.post(srv.url + "/reset_prefix_cache") as r:
            assert r.status == 200 and await r.json() == {"success": True}
        # vLLM publishes events per engine step: the reset goes out with the next one
        await complete(s, srv.url, [40_000 + i for i in range(BS)], 1)
        await wait_for(sub, lambda: len(stored_events(sub.batches(start))) >= 1)
        kinds = [type(ev).__name__ for b in sub.batches(start) for ev in b.events]
    assert kinds == ["AllBlocksCleared", "BlockStored"]


# ----------------------------------------------------------------------------- the command and the config


async def test_cli_binds_wildcard_endpoints_on_its_host_and_reports_the_ports(
        tmp_path: Path, tokenizer_path: Path) -> None:
    exe = Path(sys.executable).with_name("skymesh")
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})
    child = Child("replica-kv", [str(exe), "replica-sim", "--port", "0", "--profile", "tiny-test",
                                 "--time-scale", "0.01", "--tokenizer", str(tokenizer_path),
                                 "--kv-events-config", cfg], tmp_path)
    child.start()
    sub: Subscriber | None = None
    try:
        ports = await child.wait_ready(within_s=60)
        assert set(ports) == {"http", "kv_events", "kv_replay"}
        sub = Subscriber(bind=False, endpoint=f"tcp://127.0.0.1:{ports['kv_events']}")
        url = f"http://127.0.0.1:{ports['http']}"
        async with aiohttp.ClientSession() as s:
            k = 0
            while not sub.messages:  # until subscribed (see subscribed())
                await complete(s, url, [50_000 + 100 * k + i for i in range(BS)], 1)
                k += 1
                assert k < MAX_PROBES, "no batch reached the subscriber"
                await asyncio.sleep(0.01)
        got, _ = await asyncio.to_thread(replay, f"tcp://127.0.0.1:{ports['kv_replay']}", 0)
        assert [seq for _, seq, _ in got] == list(range(k))
        assert stored_events([decode(p) for _, _, p in got])[0].token_ids == list(range(50_000, 50_000 + BS))
        child.signal_group(signal.SIGTERM)
        assert child.proc is not None
        assert await asyncio.to_thread(child.proc.wait, 20) == 0, child.tail()
    finally:
        if sub is not None:
            sub.close()
        await child.stop()


def test_cli_refuses_a_bad_kv_events_config(capsys: pytest.CaptureFixture[str]) -> None:
    from skymesh.cli import main as skymesh_main

    with pytest.raises(SystemExit) as ei:
        skymesh_main(["replica-sim", "--port", "0", "--kv-events-config", '{"enable_kv_cache_events": 1, "x": 2}'])
    assert ei.value.code == 2
    assert "bad --kv-events-config: x: Extra inputs are not permitted" in capsys.readouterr().err


def sim_config(**sim: Any) -> dict[str, Any]:
    data = one_region_config({"r1": "http://127.0.0.1:8201"}, 8101, 8102)
    data["regions"][0]["replicas"][0] = {"id": "r1", "sim": {"profile": "tiny-test", "port": 8201, **sim}}
    return data


def test_sim_kv_events_in_the_config() -> None:
    cfg = parse_config(sim_config(tokenizer="/models/m/tokenizer.json",
                                  kv_events={"port": 5557, "replay_port": 5558, "topic": "r1"}))
    rep = cfg.regions[0].replicas[0]
    assert rep.sim is not None and rep.sim.tokenizer == "/models/m/tokenizer.json"
    assert rep.kv_events is not None  # what the balancer subscribes to, derived
    assert (rep.kv_events.endpoint, rep.kv_events.replay_endpoint, rep.kv_events.topic) == \
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "r1")
    assert rep.kv_events.max_blocks == PROFILES["tiny-test"].num_gpu_blocks
    assert rep.sim.kv_events is not None
    stand_in = KVEventsConfig.from_json(rep.sim.kv_events.vllm_json())  # what the stand-in gets
    assert stand_in.publishes and stand_in.topic == "r1" and stand_in.buffer_steps == 10_000
    assert (stand_in.endpoint, stand_in.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    bare = parse_config(sim_config(kv_events={"port": 5557})).regions[0].replicas[0]
    assert bare.kv_events is not None and bare.kv_events.replay_endpoint is None
    assert parse_config(sim_config()).regions[0].replicas[0].kv_events is None  # off by default


@pytest.mark.parametrize(("kv_events", "where"), [
    ({"port": 8201}, "sim.kv_events.port"),  # the HTTP port
    ({"port": 5557, "replay_port": 5557}, "sim.kv_events.replay_port"),
    ({"port": 0}, "sim.kv_events.port"),
    ({"port": 5557, "buffer_step": 3}, "sim.kv_events.buffer_step"),
])
def test_sim_kv_events_errors_name_the_path(kv_events: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_config(sim_config(kv_events=kv_events))
    assert str(ei.value).startswith(f"regions[0].replicas[0].{where}:"), str(ei.value)


def test_a_sim_replica_takes_its_kv_events_from_the_sim_section() -> None:
    data = sim_config(kv_events={"port": 5557})
    data["regions"][0]["replicas"][0]["kv_events"] = {"endpoint": "tcp://127.0.0.1:5557"}
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.kv_events: .*sim\.kv_events"):
        parse_config(data)


async def test_skymesh_up_starts_a_sim_that_publishes_with_its_tokenizer(tmp_path: Path, tokenizer_path: Path) -> None:
    from tokenizers import Tokenizer

    from skymesh.operations.up import Mesh
    from skymesh.runtime.procs import free_port

    data = sim_config(tokenizer=str(tokenizer_path), kv_events={"port": free_port(), "replay_port": free_port()})
    data["regions"][0]["replicas"][0]["sim"]["port"] = free_port()
    mesh = Mesh.from_dict(data, tmp_path / "run", time_scale=0.01)
    rep = mesh.cfg.regions[0].replicas[0]
    assert rep.kv_events is not None and rep.kv_events.replay_endpoint is not None
    prompt = "Prefix caching stores the key and value tensors of every full block. " * 4
    ids = Tokenizer.from_file(str(tokenizer_path)).encode(prompt).ids
    await mesh.start_replica("r1")
    sub: Subscriber | None = None
    try:
        sub = Subscriber(bind=False, endpoint=rep.kv_events.endpoint)  # where the balancer connects
        async with aiohttp.ClientSession() as s:
            k = 0
            while not sub.messages:  # until subscribed (see subscribed())
                await complete(s, rep.url, [60_000 + 100 * k + i for i in range(BS)], 1)
                k += 1
                assert k < MAX_PROBES, "no batch reached the subscriber"
                await asyncio.sleep(0.01)
            await complete(s, rep.url, prompt, 1)
        got, _ = await asyncio.to_thread(replay, rep.kv_events.replay_endpoint, k)
        (ev,) = stored_events([decode(p) for _, _, p in got])
        assert ev.token_ids == ids[: len(ids) // BS * BS]
    finally:
        if sub is not None:
            sub.close()
        await mesh.stop()


async def test_a_balancer_keeps_the_stand_ins_cache_from_its_events(tmp_path: Path, tokenizer_path: Path) -> None:
    """End to end with the balancer's own subscriber: stand-ins with the tokenizer publish,
    the balancer (same tokenizer, chunks = blocks) indexes their events, and the replica
    that served a prompt holds every full block of it under the balancer's chunk keys."""
    from skymesh.balancer.server import Balancer
    from skymesh.runtime.procs import free_port

    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    srvs = [await start_replica(profile="tiny-test", time_scale=0.01, tokenizer=tokenizer_path, kv_events=events)
            for _ in range(2)]
    b: Balancer | None = None
    try:
        data = one_region_config({f"r{i}": srv.url for i, srv in enumerate(srvs)}, free_port(), free_port(),
                                 name="prefix_tree", probe_interval_s=0.05, chunk_tokens=BS)
        data["tokenizer"] = {"path": str(tokenizer_path)}
        for i, srv in enumerate(srvs):
            data["regions"][0]["replicas"][i]["kv_events"] = {
                "endpoint": srv.engine_loop.kv_publisher.endpoint, "replay_endpoint": srv.engine_loop.kv_publisher.replay_endpoint}
        b = Balancer(parse_config(data), "us-east-1")
        await b.start(port=0)
        prompt = "A load balancer keeps the cache warm by sending shared prefixes to one replica. " * 3
        enc = PromptEncoder.from_files(BS, tokenizer_path)
        chunks = enc.encode_text(prompt).chunk_hashes
        full = len(enc.tokenizer.encode(prompt).ids) // BS  # P + 1 - 1 tokens computed: the full blocks
        assert full >= 3
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{b.bound_port}/v1/completions",
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()
                rid = r.headers["X-Skymesh-Replica"]
            srv = srvs[int(rid[1:])]
            k = 0
            # the subscriber replays from 0 on the first batch it receives; more batches
            # come until it has (a PUB drops what precedes the subscription)
            while (idx := b.core.kv_indexes.by_replica.get(rid)) is None or idx.cached_chunks(chunks) < full:
                await complete(s, srv.url, [70_000 + 100 * k + i for i in range(BS)], 1)
                k += 1
                assert k < MAX_PROBES, "the balancer's index never held the prompt"
                await asyncio.sleep(0.05)
        assert idx.cached_chunks(chunks) == full and idx.orphans == 0
        assert b.admin_status()["replicas"][rid]["cache_source"] == "events"
    finally:
        if b is not None:
            await b.stop()
        for srv in srvs:
            await srv.close()
