"""Prefill/decode pairs live: a balancer in front of a prefill stand-in and a decode
stand-in that play vLLM 0.32's NIXL pull protocol. Every request is split (the ``always``
rule): its prefill leg on the prefill replica, whose blocks the decode leg then reads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from skymesh.balancer.server import Balancer
from skymesh.balancer.services import ControllerLink
from skymesh.config import parse_config
from skymesh.replica_sim.kv_transfer import KVTransferSettings
from skymesh.replica_sim.server import ReplicaServer, start_replica
from skymesh.runtime.procs import free_port
from tests.mesh_helpers import admin_auth, one_region_config
from tests.test_replica_sim_server import parse_metrics

pytestmark = [pytest.mark.timeout(120)]

PROMPT = " ".join(f"w{i}" for i in range(300))
EXTERNAL = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="skymesh-sim",source="external_kv_transfer"}'


async def wait_for(cond: Any, what: str) -> None:
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(what)


async def split_region(prefill_connector: bool, **sections: Any) -> tuple[Balancer, ReplicaServer, ReplicaServer]:
    p = await start_replica(profile="tiny-test", time_scale=0.05,
                            kv_transfer=KVTransferSettings() if prefill_connector else None)
    d = await start_replica(profile="tiny-test", time_scale=0.05, kv_transfer=KVTransferSettings())
    data = one_region_config({"r0": p.url, "r1": d.url}, free_port(), free_port(), name="least_load")
    data["regions"][0]["replicas"][0]["role"] = "prefill"
    data["regions"][0]["replicas"][1]["role"] = "decode"
    data["pairing"] = {"rule": "always", "profile": "tiny-test"}
    data.update(sections)
    b = Balancer(parse_config(data), "us-east-1")
    await b.start(port=0)
    await wait_for(lambda: all(v.healthy for v in b.core.view.replicas.values()), "replicas never became healthy")
    return b, p, d


@pytest.fixture
async def region() -> AsyncIterator[tuple[Balancer, ReplicaServer, ReplicaServer]]:
    b, p, d = await split_region(True)
    try:
        yield b, p, d
    finally:
        await b.stop()
        await p.close()
        await d.close()


async def ask(s: aiohttp.ClientSession, b: Balancer, stream: bool, n: int) -> tuple[int, str]:
    body = {"model": "skymesh-sim", "prompt": f"{n} {PROMPT}", "max_tokens": 6, "stream": stream}
    async with s.post(f"http://127.0.0.1:{b.bound_port}/v1/completions", json=body) as r:
        return r.status, await r.text()


async def test_split_requests_are_served_through_both_legs(region: Any) -> None:
    b, p, d = region
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(ask(s, b, stream=i % 2 == 0, n=i) for i in range(6)))
        for status, text in answers:
            assert status == 200, text
        for _, text in answers[1::2]:  # non-streaming: the client's own answer, 6 tokens
            body = json.loads(text)
            assert body["usage"]["completion_tokens"] == 6
        for _, text in answers[::2]:
            assert text.rstrip().endswith("data: [DONE]")
        async with s.get(d.url + "/metrics") as r:
            samples = parse_metrics(await r.text())[0]
    # the decode replica read every prompt's KV; the prefill replica holds none now
    assert samples[EXTERNAL] > 0
    assert not p.engine.held and not p.engine.requests
    assert p.engine.generation_tokens_total == 6  # one token per prefill leg
    view = b.core.view.replicas
    assert view["r1"].pending_decodes == 0 and view["r0"].in_flight == 0


async def test_the_admin_status_and_the_controller_report_name_each_replicas_role(region: Any) -> None:
    b, _, _ = region
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{b.bound_port}/admin/status", headers=admin_auth()) as r:
            assert r.status == 200
            status = await r.json()
    assert {rid: x["role"] for rid, x in status["replicas"].items()} == {"r0": "prefill", "r1": "decode"}
    one_each = {"both": 0, "prefill": 1, "decode": 1}
    assert status["replicas_by_role"] == status["healthy_by_role"] == one_each
    assert status["available_by_role"] == one_each  # idle, both probed
    report = ControllerLink(b.controller_link_port).report()
    assert {x.replica_id: x.role for x in report.replicas} == {"r0": "prefill", "r1": "decode"}
    # its peers hear of the one replica a new request may start on
    beat = b.peer_mesh_port.heartbeat_snapshot(asyncio.get_running_loop().time())
    assert (beat.replicas_total, beat.replicas_available) == (1, 1)


async def test_a_prefill_replica_that_answers_no_params_leaves_the_prefill_to_the_decode_replica() -> None:
    b, p, d = await split_region(False)
    try:
        async with aiohttp.ClientSession() as s:
            status, text = await ask(s, b, stream=False, n=1)
            async with s.get(d.url + "/metrics") as r:
                samples = parse_metrics(await r.text())[0]
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 6
        assert samples.get(EXTERNAL, 0.0) == 0  # computed there, nothing read
    finally:
        await b.stop()
        await p.close()
        await d.close()


async def test_a_decode_replica_that_is_gone_ends_the_request_with_an_answer_not_a_hang() -> None:
    b, p, d = await split_region(True, upstream={"max_queue_wait_s": 2.0})
    try:
        await d.close()  # the decode leg is refused; its probes eject it soon after
        async with aiohttp.ClientSession() as s:
            status, text = await ask(s, b, stream=False, n=2)
        # no replica may decode it: answered within its bounds (a retry spent, or its queue
        # wait once the decode replica was ejected), nothing hangs
        assert status in (502, 503, 504), text
        assert json.loads(text)["error"]["code"] in ("upstream_unavailable", "no_capacity", "queue_timeout")
        assert not b.core.view.replicas["r1"].pending_decodes
    finally:
        await b.stop()
        await p.close()


def test_the_configs_pair_rule_names_are_the_registrys() -> None:
    from typing import get_args

    from skymesh.config.pairing import PairRuleConfigName
    from skymesh.routing.pair_registry import PAIR_RULES

    assert set(get_args(PairRuleConfigName)) == set(PAIR_RULES)


def test_a_pair_rule_needs_a_profile_to_price_by() -> None:
    from skymesh.assembly import pairing_settings
    from skymesh.config.pairing import PairingConfig

    with pytest.raises(ValueError, match="pairing.profile"):
        pairing_settings(PairingConfig.model_validate({"rule": "conductor"}), ())
    with pytest.raises(ValueError, match="no such profile"):
        pairing_settings(PairingConfig.model_validate({"rule": "conductor", "profile": "nope"}), ())
    assert pairing_settings(PairingConfig(), ()) is None
    made = pairing_settings(PairingConfig.model_validate({"rule": "threshold", "profile": "tiny-test",
                                                           "options": {"threshold_tokens": 64}, "link_gbps": 8}), ())
    assert made is not None and made.options == {"threshold_tokens": 64} and made.links.bytes_per_s == 1e9


async def test_a_request_no_pair_can_serve_within_its_class_targets_gets_a_429_with_retry_after() -> None:
    from skymesh.balancer.slo_class_lookup import SLO_CLASS_HEADER

    # the conductor prices the one pair: no decode step is a microsecond long
    b, p, d = await split_region(True, pairing={"rule": "conductor", "profile": "tiny-test"},
                                 slo_classes={"instant": {"tpot_s": 1e-6}, "chat": {"ttft_s": 30.0}})
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "skymesh-sim", "prompt": f"9 {PROMPT}", "max_tokens": 6}
            async with s.post(f"http://127.0.0.1:{b.bound_port}/v1/completions", json=body,
                              headers={SLO_CLASS_HEADER: "instant"}) as r:
                refused = (r.status, r.headers.get("Retry-After"), await r.json())
            async with s.post(f"http://127.0.0.1:{b.bound_port}/v1/completions", json=body,
                              headers={SLO_CLASS_HEADER: "chat"}) as r:
                served = r.status, await r.text()
        status, retry_after, error = refused
        assert status == 429 and retry_after is not None and int(retry_after) >= 1
        assert error["error"]["code"] == "slo_unreachable" and "time between tokens" in error["error"]["message"]
        assert served[0] == 200, served[1]
        assert b.core.local.counters.refused_by_pair_rule == 1
        # the refused request never reached a replica
        assert p.engine.generation_tokens_total == 1 and b.core.view.replicas["r1"].pending_decodes == 0
    finally:
        await b.stop()
        await p.close()
        await d.close()
