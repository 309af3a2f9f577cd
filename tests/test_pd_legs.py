"""The balancer's prefill leg (skymesh/balancer/pd_legs.py) as vLLM 0.32's disaggregated
proxy sends it: the bodies of both legs, the endpoint check, and a prefill leg against a
stand-in that plays NIXL pull (its parameters then serve a decode leg there)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from skymesh.balancer.pd_legs import (
    MAX_PREFILL_ANSWER_BYTES,
    PREFILL_REQUEST_PARAMS,
    checked_params,
    decode_body,
    prefill_body,
    prefill_leg,
    replica_hosts,
)
from skymesh.balancer.proxy import AttemptTarget, UpstreamTimeouts
from skymesh.replica_sim.kv_transfer import KVTransferSettings
from skymesh.replica_sim.server import ReplicaServer, start_replica

PROMPT = " ".join(f"w{i}" for i in range(300))


def test_the_prefill_body_is_vllms_proxys() -> None:
    raw = json.dumps({"model": "m", "prompt": "hi", "stream": True, "max_tokens": 64, "max_completion_tokens": 64,
                      "stream_options": {"include_usage": True}, "min_tokens": 3, "min_completion_tokens": 3,
                      "temperature": 0.5}).encode()
    body = json.loads(prefill_body(raw))
    assert body == {"model": "m", "prompt": "hi", "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
                    "temperature": 0.5, "kv_transfer_params": PREFILL_REQUEST_PARAMS}
    # max_completion_tokens only where the client named it
    assert "max_completion_tokens" not in json.loads(prefill_body(b'{"prompt": "x"}'))


def test_the_decode_body_is_the_clients_with_the_prefills_params() -> None:
    raw = b'{"prompt": "hi", "stream": true, "max_tokens": 64, "min_tokens": 3}'
    params = {"remote_host": "127.0.0.1", "remote_port": 5600}
    assert json.loads(decode_body(raw, params)) == {"prompt": "hi", "stream": True, "max_tokens": 64,
                                                     "min_tokens": 3, "kv_transfer_params": params}
    assert decode_body(raw, None) == raw  # none: the decode replica prefills itself


def good(**over: Any) -> dict[str, Any]:
    return {"remote_block_ids": [[1, 2]], "remote_engine_id": "e", "remote_request_id": "r-1",
            "remote_host": "127.0.0.5", "remote_port": 5600, **over}


@pytest.mark.parametrize(("params", "ok"), [
    (good(), True),
    (good(remote_host="127.0.0.9"), False),  # not a replica of the region
    (good(remote_host="10.0.0.1"), False),
    (good(remote_port=0), False),
    (good(remote_port=70000), False),
    (good(remote_port="5600"), False),
    (good(remote_port=True), False),
    (good(remote_engine_id=None), False),
    ({k: v for k, v in good().items() if k != "remote_request_id"}, False),
    (None, False),
    ([1, 2], False),
])
def test_params_are_kept_only_for_an_endpoint_of_the_regions_replicas(params: Any, ok: bool) -> None:
    hosts = replica_hosts(["http://127.0.0.5:8001", "http://127.0.0.6:8001"])
    assert (checked_params(params, hosts) is not None) is ok


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Awaitable[ReplicaServer]]]:
    started: list[ReplicaServer] = []

    async def start(connector: bool = True) -> ReplicaServer:
        kv = KVTransferSettings() if connector else None
        srv = await start_replica(profile="tiny-test", time_scale=0.05, kv_transfer=kv)
        started.append(srv)
        return srv

    try:
        yield start
    finally:
        for srv in started:
            await srv.close()


def target(session: aiohttp.ClientSession, srv: ReplicaServer, path: str = "/v1/completions") -> AttemptTarget:
    return AttemptTarget(srv.url + path, {"Content-Type": "application/json", "X-Request-Id": "pd-9"}, session,
                         lambda upstream: {})


async def test_a_prefill_legs_params_serve_the_decode_leg(servers: Any) -> None:
    p, d = await servers(), await servers()
    raw = json.dumps({"model": "skymesh-sim", "prompt": PROMPT, "max_tokens": 5, "stream": True}).encode()
    async with aiohttp.ClientSession() as s:
        result = await prefill_leg(target(s, p), raw, UpstreamTimeouts(), 30.0)
        assert result.ok and result.params is not None
        params = checked_params(result.params, replica_hosts([p.url, d.url]))
        assert params is not None and p.engine.held
        async with s.post(d.url + "/v1/completions", data=decode_body(raw, params),
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200
            text = await r.text()
        assert "data: [DONE]" in text and not p.engine.held  # read: the prefill's blocks are free


async def test_a_prefill_replica_without_a_connector_answers_no_params(servers: Any) -> None:
    p = await servers(connector=False)
    async with aiohttp.ClientSession() as s:
        result = await prefill_leg(target(s, p), json.dumps({"prompt": PROMPT, "max_tokens": 5}).encode(),
                                   UpstreamTimeouts(), 30.0)
    assert result.ok and result.params is None


async def test_a_failed_or_refused_prefill_leg_says_how(servers: Any) -> None:
    p = await servers()
    async with aiohttp.ClientSession() as s:
        bad = await prefill_leg(target(s, p), json.dumps({"model": "skymesh-sim", "prompt": PROMPT, "n": 0}).encode(),
                                UpstreamTimeouts(), 30.0)
        assert not bad.ok and bad.reason == "prefill: HTTP 400" and bad.counts_against_health
        url = p.url
        await p.close()
        gone = await prefill_leg(AttemptTarget(url + "/v1/completions", {}, s, lambda u: {}),
                                 json.dumps({"prompt": PROMPT}).encode(), UpstreamTimeouts(connect_s=1.0), 30.0)
    assert not gone.ok and gone.reason.startswith("prefill: ")


def test_the_answer_bound_is_well_above_one_tokens_answer() -> None:
    assert MAX_PREFILL_ANSWER_BYTES >= 64 * 1024


def test_a_prefill_leg_is_bounded_by_its_prediction_or_target_not_the_generic_timeout() -> None:
    t = UpstreamTimeouts(first_byte_s=60.0, leg_multiple=4.0, leg_floor_s=5.0)
    # a 2 s target and a 0.5 s prediction: 4 x 2 s
    assert t.prefill_leg_deadline_s(predicted_ttft_s=0.5, ttft_target_s=2.0) == 8.0
    # a queue predicted longer than the target: 4 x the prediction
    assert t.prefill_leg_deadline_s(predicted_ttft_s=3.0, ttft_target_s=2.0) == 12.0
    # never below the floor, never past the generic first-byte bound
    assert t.prefill_leg_deadline_s(predicted_ttft_s=None, ttft_target_s=0.1) == 5.0
    assert t.prefill_leg_deadline_s(predicted_ttft_s=30.0, ttft_target_s=2.0) == 60.0


def test_a_decode_leg_is_bounded_by_its_kv_move_then_its_generation() -> None:
    t = UpstreamTimeouts(first_byte_s=60.0, per_output_token_s=0.2, leg_multiple=4.0, leg_floor_s=5.0)
    assert t.decode_leg_deadline_s(transfer_s=0.01, stream=True, max_tokens=100) == 5.0
    assert t.decode_leg_deadline_s(transfer_s=3.0, stream=True, max_tokens=100) == 12.0
    # not streamed: the whole generation on top, as for any attempt
    assert t.decode_leg_deadline_s(transfer_s=3.0, stream=False, max_tokens=100) == 12.0 + 20.0
    assert t.decode_leg_deadline_s(transfer_s=100.0, stream=True, max_tokens=1) == 60.0
