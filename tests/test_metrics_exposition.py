"""The /metrics pages against golden copies of the hand-written writers' output (captured
before the port to prometheus_client, tests/golden/), and the probe-side parser."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest

from skymesh.balancer.metrics import (
    BalancerMetrics,
    BalancerSnapshot,
    PeerHealth,
    ReplicaLoad,
    balancer_snapshot,
)
from skymesh.balancer.prober import parse_probe, probe_replica
from skymesh.replica_sim.vllm_metrics import ReplicaMetrics, vllm_cache_config_info
from skymesh.routing.base import Decision, RoutingRequest
from skymesh.routing.health import ProbeSample
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.region import RegionCore
from skymesh.routing.registry import make_policy
from skymesh.runtime.prom_text import parse_samples

GOLDEN = Path(__file__).parent / "golden"


def mask_created_values(text: str) -> str:
    """_created samples hold the Unix time a series was created: the one part that differs
    between two renders of the same state."""
    return re.sub(r"^(\S+_created(?:\{[^}]*\})?) \S+$", r"\1 <created>", text, flags=re.M)


def test_stand_in_page_is_byte_identical_to_the_vllm_format_golden() -> None:
    # the state tests/golden/replica_sim_metrics.txt was rendered from; a max_model_len of
    # 2M and a 10000 s TTFT put exponent-form floats (1e+06) in bounds and sums
    engine = SimpleNamespace(num_running=2, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=1234567,
                             prefix_cache_hits=1000, num_preemptions=0, prompt_tokens_total=4100,
                             generation_tokens_total=77)
    info = vllm_cache_config_info(num_gpu_blocks=2816, block_size=16, max_model_len=2_000_000,
                                  gpu_memory_utilization=0.95)
    m = ReplicaMetrics(engine, "meta-llama/Llama-3.1-8B-Instruct", 2_000_000, cache_config_info=info)
    for v in (0.0005, 0.05, 3.0, 10000.0):
        m.ttft.observe(v)
    m.itl.observe(0.02)
    m.finished("length", 12.5, 0.1, 0.2, 12.2, 1_500_000, 64)
    m.finished("stop", 1.0, 0.0, 0.5, 0.5, 7, 3)
    m.finished("abort", 0.0, 0.0, 0.0, 0.0, 7, 0)
    page = generate_latest(m.registry).decode()
    golden = (GOLDEN / "replica_sim_metrics.txt").read_text()
    # every line: HELP/TYPE text, metric names, label names and values, bucket bounds,
    # sample values and the page's order; the stand-in's own supervision counter is a
    # family of its own after all of vLLM's
    vllm_part, own = page.split("# HELP skymesh_loop_restarts_total", 1)
    assert mask_created_values(vllm_part).splitlines() == mask_created_values(golden).splitlines()
    assert 'skymesh_loop_restarts_total{loop="engine"} 0.0' in own.splitlines()
    assert "vllm:" not in own


def test_two_stand_ins_in_one_process_keep_separate_registries() -> None:
    engine = SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                             prefix_cache_hits=0, num_preemptions=0, prompt_tokens_total=0,
                             generation_tokens_total=0)
    a, b = ReplicaMetrics(engine, "m", 4096), ReplicaMetrics(engine, "m", 4096)
    a.ttft.observe(0.1)
    count = "vllm:time_to_first_token_seconds_count"
    assert parse_samples(generate_latest(a.registry).decode(), [count]) == {count: 1.0}
    assert parse_samples(generate_latest(b.registry).decode(), [count]) == {count: 0.0}


ADDED_BALANCER_FAMILIES = ("skymesh_replicas_ejected", "skymesh_request_transitions", "skymesh_loop_restarts",
                           "skymesh_internal_errors", "skymesh_rejected_peer_calls", "skymesh_config_reloads",
                           "skymesh_cache_predictions", "skymesh_slo_requests", "skymesh_slo_outcomes",
                           "skymesh_slo_target_misses", "skymesh_http_connections",
                           "skymesh_autoscaling_pending_prefill_seconds_per_replica", "skymesh_sibling_",
                           "skymesh_client_", "skymesh_harmful_requests", "skymesh_context_refusals",
                           "skymesh_requests_cut", "skymesh_replica_pages")
# prometheus_client's process, platform and GC collectors: their values are the process's own
PROCESS_FAMILIES = ("process_", "python_")


def samples_and_headers(page: str) -> tuple[dict[str, float], list[str]]:
    """{'name{labels}': value} and the # HELP / # TYPE lines in page order."""
    samples: dict[str, float] = {}
    headers: list[str] = []
    for line in page.splitlines():
        if line.startswith("#"):
            headers.append(line)
        elif line:
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples, headers


def test_balancer_page_has_the_golden_names_labels_and_values() -> None:
    # the state tests/golden/balancer_metrics.txt was rendered from
    snapshot = BalancerSnapshot(
        queue_length=3, in_flight=5, replicas_available=2, prefix_hit_ratio=0.375,
        replicas=[ReplicaLoad("r0", 2, 300), ReplicaLoad("r1", 3, 0)],
        peers=[PeerHealth("us-east", 0.5, True), PeerHealth("eu-west", float("inf"), False)],
        transitions={("queued", "placed"): 4}, loop_restarts={"probe": 1}, ejected_replicas=1,
        rejected_peer_calls={"wrong_region": 2}, pending_prefill_s_per_replica=0.75,
        sibling_link={"sent": 7, "applied": 5, "looks": 9, "quiet_looks": 2, "refused_streams": 0,
                      "dropped_too_large": 1},
    )
    m = BalancerMetrics("us-west", lambda: snapshot)
    m.decision_seconds.observe(3e-5)
    m.observe_decision(RoutingRequest("q", (), 100, 0.0),
                       Decision(replica_id="r0", estimated_ttft_s=0.2, matched_tokens=50))
    m.observed_ttft.observe(0.3)
    m.retries.labels("local").inc()
    m.rejections.labels("429").inc()
    m.rejections.labels("429").inc()
    m.offloaded.labels("out", "us-east").inc()
    m.midstream_failures.labels("peer").inc()
    page = generate_latest(m.registry).decode()
    golden_samples, golden_headers = samples_and_headers((GOLDEN / "balancer_metrics.txt").read_text())
    samples, headers = samples_and_headers(page)
    process = {k: v for k, v in samples.items() if k.startswith(PROCESS_FAMILIES)}
    assert process["process_cpu_seconds_total"] > 0 and process["process_resident_memory_bytes"] > 0
    assert any(k.startswith("python_info{") for k in process) and any(k.startswith("python_gc_") for k in process)
    samples = {k: v for k, v in samples.items() if k not in process}
    headers = [h for h in headers if not h.split()[2].startswith(PROCESS_FAMILIES)]
    # families added after the golden was taken (lifecycle, supervision, ejection, reloads)
    added = {k: v for k, v in samples.items() if k.startswith(ADDED_BALANCER_FAMILIES)}
    assert added == {
        'skymesh_replicas_ejected{region="us-west"}': 1.0,
        'skymesh_request_transitions_total{from_state="queued",to_state="placed"}': 4.0,
        'skymesh_loop_restarts_total{loop="probe"}': 1.0,
        "skymesh_internal_errors_total": 0.0,
        "skymesh_harmful_requests_total": 0.0,
        'skymesh_rejected_peer_calls_total{reason="wrong_region"}': 2.0,
        'skymesh_config_reloads_total{result="ok"}': 0.0,
        'skymesh_config_reloads_total{result="error"}': 0.0,
        "skymesh_http_connections_open": 0.0,
        'skymesh_autoscaling_pending_prefill_seconds_per_replica{region="us-west"}': 0.75,
        'skymesh_sibling_messages_total{direction="sent"}': 7.0,
        'skymesh_sibling_messages_total{direction="applied"}': 5.0,
        'skymesh_sibling_messages_dropped_total{reason="too_large"}': 1.0,
        'skymesh_sibling_state_looks_total{outcome="sent"}': 7.0,
        'skymesh_sibling_state_looks_total{outcome="quiet"}': 2.0,
        "skymesh_sibling_streams_refused_total": 0.0,
        'skymesh_replica_pages_total{source="probed"}': 0.0,
        'skymesh_replica_pages_total{source="sibling"}': 0.0,
    }
    # prometheus_client writes a histogram's _count before its _sum: the sample set is what
    # a scraper sees, so that is what must match; no _created series is added
    assert {k: v for k, v in samples.items() if k not in added} == golden_samples
    assert [h for h in headers if not h.split()[2].startswith(ADDED_BALANCER_FAMILIES)] == golden_headers


def test_two_balancers_in_one_process_keep_separate_registries() -> None:
    empty = BalancerSnapshot(0, 0, 0, 0.0, [], [])
    a, b = BalancerMetrics("a", lambda: empty), BalancerMetrics("b", lambda: empty)
    a.rejections.labels("429").inc()
    assert 'skymesh_rejections_total{status="429"} 1.0' in generate_latest(a.registry).decode()
    assert "skymesh_rejections_total{" not in generate_latest(b.registry).decode()


async def test_balancer_snapshot_reads_the_balancers_load() -> None:
    # a real (pure) region core with one request placed and one peer heard from
    core = RegionCore("here", make_policy("least_load"), OffloadRouter("here", {"eu": 0.05}))
    core.set_replicas(["r0"], 0.0)
    core.probe("r0", ProbeSample(), 0.0)
    core.submit(RoutingRequest("q0", (1,), 64, 0.0), 0.0)
    core.tick(0.0)
    now = asyncio.get_running_loop().time()
    core.peer_heartbeat("eu", HeartbeatSnapshot(2, 0, 0, 0), now, epoch=1, seq=1)
    b = SimpleNamespace(core=core, offload=core.offload, prefix_hit_ratio=lambda: 0.5,
                        loop_restart_counts=lambda: {"probe": 2},
                        peer_mesh_port=SimpleNamespace(rejected_peer_calls=lambda: {}),
                        sibling_link_counts=lambda: {"sent": 3})
    snap = balancer_snapshot(b)  # type: ignore[arg-type]
    assert (snap.queue_length, snap.in_flight, snap.replicas_available, snap.prefix_hit_ratio) == (0, 1, 1, 0.5)
    assert snap.replicas == [ReplicaLoad("r0", 1, 64)]
    (peer,) = snap.peers
    assert peer.region == "eu" and not peer.available and 0 <= peer.staleness_s < 60
    assert snap.transitions == {("new", "queued"): 1, ("queued", "placed"): 1}
    assert snap.loop_restarts == {"probe": 2} and snap.ejected_replicas == 0
    assert snap.sibling_link == {"sent": 3}


def test_parse_samples_sums_label_sets_and_skips_comments() -> None:
    page = ("# HELP x_total a counter\n# TYPE x_total counter\n"
            'x_total{a="1"} 2.0\nx_total{a="2"} 3.5\ny 7\nx_total_created 1.7e+09\n')
    assert parse_samples(page, ["x_total", "y", "z"]) == {"x_total": 5.5, "y": 7.0}


def test_parse_samples_reads_the_value_not_a_timestamp_nor_a_label() -> None:
    page = ('x{a="b} c"} 2.0 1700000000000\n'  # label value with a brace and a space, timestamp
            "y 3 1700000000000\n"
            "x\n"  # a bare name
            'x{a="1"}\n'  # no value
            "x{a=\"2\"} not-a-number\n")
    assert parse_samples(page, ["x", "y"]) == {"x": 2.0, "y": 3.0}


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "garbage", ""])
def test_probe_of_a_malformed_gauge_is_unhealthy_not_an_exception(value: str) -> None:
    page = (f'vllm:num_requests_running{{engine="0",model_name="m"}} {value}\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n')
    res = parse_probe(page)
    assert not res.healthy
    assert res.error


def test_probe_of_a_non_finite_cache_counter_is_unhealthy() -> None:
    page = ('vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN\n')
    res = parse_probe(page)
    assert not res.healthy and "vllm:kv_cache_usage_perc" in res.error


def test_probe_of_a_well_formed_page() -> None:
    page = ('vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0\n')
    res = parse_probe(page)
    assert res.healthy and (res.num_running, res.num_waiting) == (2, 3)
    assert math.isclose(res.kv_usage, 0.5) and (res.prefix_queries, res.prefix_hits) == (100.0, 40.0)


async def test_probe_of_an_undecodable_page_is_unhealthy_not_an_exception() -> None:
    async def metrics(_: web.Request) -> web.Response:
        body = b'vllm:num_requests_running{engine="0"} \xff\xfe\nvllm:num_requests_waiting{engine="0"} 0.0\n'
        return web.Response(body=body, headers={"Content-Type": "text/plain; charset=utf-8"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        res = await probe_replica(session, str(server.make_url("")).rstrip("/"), timeout_s=5.0)
    assert not res.healthy and res.error
