"""OpenTelemetry tracing of the balancers (skymesh/balancer/tracing.py, docs/observability.md).

The must-show: a request offloaded from us-east-1 to eu-west-1 is one trace, with spans
from both balancers exported over OTLP/HTTP to a local receiver: eu-west-1's server span
is a child of us-east-1's forward span (the W3C ``traceparent`` rode the mTLS forward),
and the stand-in replica behind eu-west-1 was handed a ``traceparent`` naming
eu-west-1's attempt span as its parent (read off the wire by a recording relay in front
of it, as vLLM would join it). Real balancers in this process, mTLS between them, the
real stand-in replica as a process, all on loopback.

And: a retried request has one attempt span per try (the retry count, the outcome, each
replica handed its own attempt as parent); the config's own rules; with tracing off the
balancer loads no OpenTelemetry module at all.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from benchmarks.peer_capture import RecordingRelay
from skymesh.balancer.server import Balancer
from skymesh.config import ConfigError, parse_config
from skymesh.runtime.procs import Child, free_port, start_sim_replicas
from skymesh.security.pki import generate_mesh_pki
from tests.mesh_helpers import ROOT, one_region_config
from tests.otlp_receiver import CLIENT, INTERNAL, SERVER, OtlpReceiver
from tests.test_balancer_faults import FakeReplica
from tests.test_peer_tls import EU, US, region, started, wait_for

TRACEPARENT_RE = re.compile(rb"traceparent: 00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})", re.IGNORECASE)


def traced_mesh(tmp_path: Path, regions: list[dict[str, Any]], endpoint: str) -> Any:
    return parse_config({
        "model": "skymesh-sim",
        "regions": regions,
        "latencies": [{"regions": [US, EU], "one_way_ms": 40}],
        "controller": {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}"},
        "dns": {"name": "llm.skymesh.local", "listen": f"127.0.0.1:{free_port(span=2)}"},
        "policy": {"name": "dualmap", "ttft_slo_s": 2.0, "probe_interval_s": 0.05},
        "offload": {"enabled": True, "trigger": "saturated", "heartbeat_interval_s": 0.05},
        "health": {"unhealthy_threshold": 1},
        "emulate_latency": False,
        "tls": generate_mesh_pki(tmp_path / "pki", [US, EU]),
        "tracing": {"endpoint": endpoint, "sampling_ratio": 1.0,
                    "resource_attributes": {"deployment.environment": "test"},
                    "batch": {"schedule_delay_ms": 50}},
    })


@pytest.mark.timeout(120)
@pytest.mark.fault
async def test_an_offloaded_request_is_one_trace_across_both_balancers_and_the_replica(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    await receiver.start()
    children: list[Child] = []
    balancers: list[Balancer] = []
    relay: RecordingRelay | None = None
    try:
        children, (replica_url,) = await start_sim_replicas(1, "tiny-test", 0.001, tmp_path)
        # eu-west-1's replica is reached through a relay that keeps the bytes it carries
        relay_port = free_port()
        relay = RecordingRelay(relay_port, ("127.0.0.1", int(replica_url.rsplit(":", 1)[1])))
        await relay.start()
        # us-east-1's only replica is down: its request is offloaded to eu-west-1
        us = region(US, "127.1.0.0/16", f"http://127.0.0.1:{free_port()}")
        eu = region(EU, "127.2.0.0/16", f"http://127.0.0.1:{relay_port}")
        cfg = traced_mesh(tmp_path, [us, eu], receiver.endpoint)
        balancers += [await started(cfg, EU, peers=True), await started(cfg, US, peers=True)]
        b_eu, b_us = balancers
        loop = asyncio.get_running_loop()
        await wait_for(lambda: EU in b_us.core.offload.candidates(loop.time()), "eu-west-1 is an offload target")
        client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        async with aiohttp.ClientSession() as s:
            body = {"model": "skymesh-sim", "prompt": "trace me across the ocean", "max_tokens": 4}
            async with s.post(f"http://127.0.0.1:{b_us.bound_port}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-Skymesh-Path"] == f"{US}>{EU}"
            # a client's own traceparent is taken as the parent (routing never reads it)
            async with s.post(f"http://127.0.0.1:{b_us.bound_port}/v1/completions", json=body,
                              headers={"traceparent": f"00-{client_trace}-{client_span}-01"}) as r:
                assert r.status == 200, await r.text()
        for b in reversed(balancers):
            await b.stop()  # flushes the spans still batched
        balancers.clear()

        # the first request: the balancer began its trace
        us_request = next(s for s in receiver.named("skymesh.request", US) if s.parent_span_id == "")
        trace_id = us_request.trace_id
        spans = [s for s in receiver.spans if s.trace_id == trace_id]
        by_id = {s.span_id: s for s in spans}
        assert us_request.kind == SERVER and us_request.attributes["http.response.status_code"] == 200
        assert us_request.resource["service.name"] == "skymesh-balancer"
        assert us_request.resource["deployment.environment"] == "test"
        assert us_request.resource["skymesh.balancer.id"] == b_us.balancer_id
        placement = us_request.event("skymesh.placement")
        assert placement["skymesh.placement.region"] == EU and placement["skymesh.policy"] == "dualmap"
        queue_waits = [s for s in spans if s.name == "skymesh.queue_wait" and s.parent_span_id == us_request.span_id]
        assert queue_waits and queue_waits[-1].kind == INTERNAL
        assert queue_waits[-1].attributes["skymesh.queue.outcome"] == "forwarded"
        (forward,) = [s for s in spans if s.name == "skymesh.forward"]
        assert forward.kind == CLIENT and forward.parent_span_id == us_request.span_id
        assert forward.resource["skymesh.region"] == US
        assert forward.attributes["skymesh.peer_region"] == EU and forward.attributes["skymesh.outcome"] == "served"
        assert forward.attributes["skymesh.retries"] == 0

        # eu-west-1's span of the proxied request: in the same trace, a child of the forward
        (eu_request,) = [s for s in spans if s.resource.get("skymesh.region") == EU and s.name == "skymesh.request"]
        assert eu_request.kind == SERVER and eu_request.parent_span_id == forward.span_id
        assert eu_request.attributes["skymesh.forwarded"] is True
        assert eu_request.attributes["skymesh.origin_region"] == US
        eu_placement = eu_request.event("skymesh.placement")
        assert eu_placement["skymesh.placement.replica"] == "eu-west-1-r0"
        assert "skymesh.placement.predicted_cached_tokens" in eu_placement
        assert len(eu_placement["skymesh.placement.candidates"]) == 2  # DualMap's pair
        (attempt,) = [s for s in spans if s.name == "skymesh.attempt"]
        assert attempt.kind == CLIENT and attempt.parent_span_id == eu_request.span_id
        assert attempt.resource["skymesh.region"] == EU
        assert attempt.attributes["skymesh.replica"] == "eu-west-1-r0"
        assert attempt.attributes["skymesh.outcome"] == "served"

        # the replica was handed the attempt span as its parent
        received = {(t.decode(), p.decode()): int(flags, 16) for t, p, flags in TRACEPARENT_RE.findall(relay.captured)}
        assert received.get((trace_id, attempt.span_id), 0) & 1  # sampled (bit 1: a random trace id)
        # every span of the trace hangs off the first balancer's server span
        for s in spans:
            node = s
            while node.parent_span_id:
                node = by_id[node.parent_span_id]
            assert node is us_request, s.name

        # the second request joined the client's trace under the client's span
        (joined,) = [s for s in receiver.named("skymesh.request", US) if s.trace_id == client_trace]
        assert joined.parent_span_id == client_span
        assert [s.parent_span_id for s in receiver.named("skymesh.request", EU) if s.trace_id == client_trace]
    finally:
        for b in reversed(balancers):
            await b.stop()
        if relay is not None:
            await relay.stop()
        await asyncio.gather(*(c.stop() for c in children))
        await receiver.stop()


class TracedReplica(FakeReplica):
    """A fake replica that keeps each request's traceparent and answers 503 while the
    shared ``overloaded`` budget lasts."""

    def __init__(self, name: str, overloaded: list[int]) -> None:
        super().__init__(name)
        self.overloaded = overloaded
        self.traceparents: list[str | None] = []

    async def _completions(self, request: web.Request) -> web.Response:
        self.traceparents.append(request.headers.get("traceparent"))
        if self.overloaded[0] > 0:
            self.overloaded[0] -= 1
            return web.Response(status=503, text="busy")
        return await super()._completions(request)


@pytest.mark.timeout(60)
async def test_a_retried_request_has_one_attempt_span_per_try(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    await receiver.start()
    overloaded = [1]  # the first completion either replica gets is refused
    replicas = [TracedReplica("r0", overloaded), TracedReplica("r1", overloaded)]
    b: Balancer | None = None
    try:
        for r in replicas:
            await r.start()
        data = one_region_config({r.name: r.url for r in replicas}, free_port(), free_port(), name="round_robin")
        data["tracing"] = {"endpoint": receiver.endpoint, "batch": {"schedule_delay_ms": 50}}
        b = Balancer(parse_config(data), US)
        await b.start(port=0)
        await wait_for(lambda: b.core.view.available_count() == 2, "both replicas probed")
        async with aiohttp.ClientSession() as s:
            body = {"model": "skymesh-sim", "prompt": "retry me", "max_tokens": 4}
            async with s.post(f"http://127.0.0.1:{b.bound_port}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        await b.stop()
        b = None
        (request,) = receiver.named("skymesh.request")
        first, second = sorted(receiver.named("skymesh.attempt"), key=lambda s: s.attributes["skymesh.attempt"])
        assert first.parent_span_id == second.parent_span_id == request.span_id
        assert (first.attributes["skymesh.retries"], second.attributes["skymesh.retries"]) == (0, 1)
        assert first.attributes["skymesh.outcome"] == "failed_before_output"
        assert first.attributes["skymesh.reason"] == "HTTP 503"
        assert second.attributes["skymesh.outcome"] == "served"
        assert first.attributes["skymesh.replica"] != second.attributes["skymesh.replica"]
        waits = receiver.named("skymesh.queue_wait")
        assert [w.attributes["skymesh.queue.outcome"] for w in waits] == ["placed", "placed"]
        # each replica was handed its own attempt's span as the parent
        sent = {tp.split("-")[2] for r in replicas for tp in r.traceparents if tp}
        assert sent == {first.span_id, second.span_id}
    finally:
        if b is not None:
            await b.stop()
        await asyncio.gather(*(r.stop() for r in replicas))
        await receiver.stop()


@pytest.mark.timeout(60)
async def test_an_unsampled_request_records_nothing_but_passes_its_traceparent(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    await receiver.start()
    replica = TracedReplica("r0", [0])
    b: Balancer | None = None
    try:
        await replica.start()
        data = one_region_config({"r0": replica.url}, free_port(), free_port(), name="round_robin")
        data["tracing"] = {"endpoint": receiver.endpoint, "sampling_ratio": 0.0, "batch": {"schedule_delay_ms": 50}}
        b = Balancer(parse_config(data), US)
        await b.start(port=0)
        await wait_for(lambda: b.core.view.available_count() == 1, "the replica probed")
        async with aiohttp.ClientSession() as s:
            body = {"model": "skymesh-sim", "prompt": "do not trace me", "max_tokens": 4}
            async with s.post(f"http://127.0.0.1:{b.bound_port}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        await b.stop()
        b = None
        assert receiver.spans == []
        (traceparent,) = replica.traceparents
        assert traceparent is not None and int(traceparent.split("-")[3], 16) & 1 == 0  # sampled flag clear
    finally:
        if b is not None:
            await b.stop()
        await replica.stop()
        await receiver.stop()


def with_tracing(section: dict[str, Any]) -> Any:
    data = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    return parse_config({**data, "tracing": section})


def test_tracing_is_off_by_default_and_its_section_is_checked() -> None:
    off = parse_config(yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())).tracing
    assert not off.enabled and off.traces_url is None
    cfg = with_tracing({"endpoint": "http://127.0.0.1:4318"}).tracing
    assert cfg.traces_url == "http://127.0.0.1:4318/v1/traces" and cfg.service_name == "skymesh-balancer"
    assert cfg.sampling_ratio == 1.0
    full = with_tracing({"endpoint": "https://otel.example.com/otlp/v1/traces"}).tracing
    assert full.traces_url == "https://otel.example.com/otlp/v1/traces"
    bad: list[tuple[dict[str, Any], str]] = [
        ({"endpoint": "http://127.0.0.1:4318", "sampling_rate": 0.5}, "tracing.sampling_rate: unknown key"),
        ({"endpoint": "grpc://127.0.0.1:4317"}, "tracing.endpoint: expected an http(s) URL"),
        ({"sampling_ratio": 1.5}, "tracing.sampling_ratio"),
        ({"resource_attributes": {"skymesh.region": "x"}}, "tracing.resource_attributes.skymesh.region: is set"),
        ({"batch": {"max_queue_size": 10, "max_export_batch_size": 20}}, "tracing.batch.max_export_batch_size"),
    ]
    for section, message in bad:
        with pytest.raises(ConfigError) as ei:
            with_tracing(section)
        assert message in str(ei.value), (section, str(ei.value))


def test_with_tracing_off_the_balancer_loads_no_opentelemetry() -> None:
    code = ("import sys, skymesh.balancer.server, skymesh.balancer.main\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
            "assert not loaded, loaded\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
