"""The recorded real vLLM KV-event messages (tests/golden/vllm_kv_events.json) are what
they say they are: three ZMQ frames each (topic, 8-byte big-endian sequence number, a
msgpack EventBatch) that decode to the recorded form. Re-record them with
``SKYMESH_RECORD_GOLDEN=1 pytest tests/test_vllm_real.py -k kv_events`` (needs
``make vllm-env``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

GOLDEN = Path(__file__).parent / "golden" / "vllm_kv_events.json"


def test_golden_kv_events_decode_to_their_recorded_form() -> None:
    data = json.loads(GOLDEN.read_text())
    seqs: list[int] = []
    events: list[dict[str, Any]] = []
    for m in data["messages"]:
        topic, seq, payload = (bytes.fromhex(f) for f in m["frames_hex"])
        assert topic == b"kv-events" and len(seq) == 8
        seqs.append(int.from_bytes(seq, "big"))
        batch = msgspec.msgpack.decode(payload)
        assert batch == m["decoded"]
        # EventBatch: [ts, events, data_parallel_rank]; events are maps tagged by "type"
        ts, batch_events, dp_rank = batch
        assert isinstance(ts, float) and dp_rank == 0
        events += batch_events
    # the first two messages are consecutive: one block, then one chained to it
    assert seqs[1] == seqs[0] + 1 and seqs == sorted(seqs)
    first, second = events[0], events[1]
    assert first["type"] == second["type"] == "BlockStored"
    assert first["parent_block_hash"] is None
    assert second["parent_block_hash"] == first["block_hashes"][0]
    for e in (first, second):
        assert e["block_size"] == 128 and len(e["token_ids"]) == 128 and len(e["block_hashes"]) == 1
    # the last one evicts (one BlockRemoved per block) and stores 8 blocks
    removed = [e for e in events[2:] if e["type"] == "BlockRemoved"]
    assert removed and all(set(e) == {"type", "block_hashes", "medium", "group_idx"} for e in removed)
    stored = [e for e in events[2:] if e["type"] == "BlockStored"]
    assert [len(e["token_ids"]) for e in stored] == [8 * 128]
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for e in events for h in e["block_hashes"])
