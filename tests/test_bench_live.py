"""The live harness end to end on loopback: stand-in replicas, a skymesh balancer, the
open-loop generator; a peer router that is not installed is skipped, not failed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from skymesh.bench import live
from skymesh.bench.loadgen import _content_events
from skymesh.bench.peers import peer_available


def test_sse_event_counting() -> None:
    buf = bytearray(b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: {"c"')
    assert _content_events(buf) == (2, False)
    buf += b':3}\n\ndata: [DONE]\n\n'
    assert _content_events(buf) == (1, True)
    assert buf == b""


@pytest.mark.timeout(120)
def test_live_replay_through_a_balancer(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i * 100, "input_length": 300 + 10 * i, "output_length": 8,
             "hash_ids": [i % 3, 100 + i]} for i in range(12)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    p = argparse.ArgumentParser()
    live.add_arguments(p)
    systems = "round_robin" + ("" if peer_available("vllm-router") else ",vllm-router")
    # the balancer is configured with the classes its requests name (an unknown one would be a 400)
    classes = tmp_path / "classes.yaml"
    classes.write_text("slo_classes:\n  chat: {ttft_s: 4.0, priority: 1}\n  batch: {e2e_s: 120.0}\n")
    args = p.parse_args(["--trace", str(trace), "--systems", systems, "--requests", "12", "--replicas", "2",
                         "--profile", "tiny-test", "--time-scale", "0.5", "--slo", "4", "--timeout-s", "60",
                         "--slo-classes", str(classes), "--slo-mix", "chat=1,batch=1", "--queue-discipline", "slo",
                         "--out", str(tmp_path / "out")])
    assert live.run(args) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    m = data["systems"]["round_robin"]
    assert m["requests"] == 12 and m["completed"] == 12 and m["rejected"] == 0
    assert sum(c["requests"] for c in m["classes"].values()) == 12
    assert all(c["rejected_share"] == 0 for c in m["classes"].values())
    assert m["replicas_used"] == 2
    assert m["ttft_p50"] is not None and m["itl_p50"] is not None
    assert m["prefix_hit_rate"] is not None
    assert "vllm-router" not in data["systems"] or peer_available("vllm-router")


@pytest.mark.timeout(240)
def test_live_replay_over_the_three_region_mesh(tmp_path: Path) -> None:
    """A burst of long prompts, mostly from us-east-1 clients, over the local mesh with one
    tiny replica per region: with offload the us-east-1 overflow is served elsewhere and
    nothing is lost; region-local (`@local`) serves every request in its own region."""
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i * 5, "input_length": 900, "output_length": 16, "hash_ids": [1000 + i, 2000 + i]}
            for i in range(30)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    p = argparse.ArgumentParser()
    live.add_arguments(p)
    args = p.parse_args(["--trace", str(trace), "--systems", "dualmap,dualmap@local", "--requests", "30",
                         "--replicas", "1", "--profile", "tiny-test", "--time-scale", "1", "--slo", "10",
                         "--regions", "3", "--skew", "0.9", "--timeout-s", "90", "--load-sample-s", "0.2",
                         "--out", str(tmp_path / "out")])
    assert live.run(args) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    mesh, local = data["systems"]["dualmap"], data["systems"]["dualmap@local"]
    for m in (mesh, local):
        assert m["requests"] == 30 and m["completed"] == 30 and m["rejected"] == 0
        assert m["prefix_hit_rate"] is not None  # read from the replicas before the mesh stops
    assert mesh["offloaded_share"] > 0  # us-east-1's single replica could not hold the burst
    assert local["offloaded_share"] == 0
    assert mesh["replicas_used"] >= 2 and local["replicas_used"] >= 2  # clients in several regions
    assert data["config"]["regions"] == 3
    assert data["config"]["replicas_per_region"] == {"us-east-1": 1, "eu-west-1": 1, "ap-northeast-1": 1}
    # each client region judged on its own: the burst's offload is us-east-1's
    for m in (mesh, local):
        assert sum(r["requests"] for r in m["regions"].values()) == 30
    assert mesh["regions"]["us-east-1"]["offloaded_share"] > 0
    assert all(r["offloaded_share"] == 0 for r in local["regions"].values())
    # the balancers' per-replica load was sampled during the burst: a CV and a load plot
    assert mesh["load_cv"] is not None and mesh["load_cv"] > 0
    assert (tmp_path / "out" / "replica_load.png").stat().st_size > 0


def test_the_generator_names_each_request_s_class(tmp_path: Path) -> None:
    """Every request carries its trace row's class in X-SLO-Class (none without one), and
    the live report judges each class at the client."""
    import asyncio

    from aiohttp import web

    from skymesh.bench.loadgen import replay
    from skymesh.bench.traces import TraceRequest
    from skymesh.config import SloClassConfig

    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("X-SLO-Class"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(3):
            await resp.write(b'data: {"choices":[{"text":"x"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> list:  # type: ignore[type-arg]
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        trace = [TraceRequest(0.01 * i, 100, 3, (i,), session=i, slo_class=c)
                 for i, c in enumerate(("chat", "", "rush", "chat"))]
        try:
            return await replay(trace, lambda _r: url, 30.0)
        finally:
            await runner.cleanup()

    results = asyncio.run(main())
    assert sorted(seen, key=str) == sorted(["chat", None, "rush", "chat"], key=str)
    classes = {"chat": SloClassConfig(ttft_s=30.0), "rush": SloClassConfig(e2e_s=1e-9)}
    got = live.live_class_summaries(results, classes, 0.0)
    assert got["chat"]["requests"] == 2 and got["chat"]["slo_attainment"] == 1.0
    assert got["rush"]["requests"] == 1 and got["rush"]["slo_attainment"] == 0.0
