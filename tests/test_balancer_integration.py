"""A real balancer in front of real stand-in replica processes on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skymesh.balancer.server import Balancer
from skymesh.config import parse_config
from skymesh.runtime.procs import Child, free_port, start_sim_replicas
from skymesh.runtime.prom_text import parse_samples
from tests.mesh_helpers import one_region_config, report_figures

pytestmark = pytest.mark.timeout(180)

N_REPLICAS = 4
# requests a replica may get between two probes; raising it to 1000 (no selective
# pushing) makes test_selective_pushing_keeps_waiting_at_the_balancer fail
SELECTIVE_PUSH_BUDGET = 2


class Cluster:
    def __init__(self, procs: dict[str, Child], urls: dict[str, str], balancer: Balancer, base: str) -> None:
        self.procs = procs
        self.urls = urls
        self.balancer = balancer
        self.base = base


async def start_cluster(tmp_path: Path, time_scale: float, sim_extra: list[str] | None = None,
                        **policy: Any) -> tuple[dict[str, Child], Balancer, str]:
    """Stand-in replicas (port 0, reported) and an in-process balancer on port 0."""
    children, replica_urls = await start_sim_replicas(N_REPLICAS, "tiny-test", time_scale, tmp_path, "r",
                                                      extra=sim_extra)
    procs = {c.name: c for c in children}  # named r0, r1, ...
    urls = {c.name: u for c, u in zip(children, replica_urls, strict=True)}
    try:
        # the config's listen ports are never bound: start(port=0) replaces the HTTP one
        # and no gRPC server runs in-process
        cfg = parse_config(one_region_config(urls, free_port(), free_port(), **policy))
        b = Balancer(cfg, "us-east-1")
        await b.start(port=0)
    except BaseException:
        await asyncio.gather(*(p.stop() for p in procs.values()))
        raise
    return procs, b, f"http://127.0.0.1:{b.bound_port}"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    procs, b, base = await start_cluster(tmp_path, time_scale=1.0)
    try:
        await wait_available(b)
        yield Cluster(procs, {r: i.url for r, i in b.replicas.items()}, b, base)
    finally:
        await b.stop()
        await asyncio.gather(*(p.stop() for p in procs.values()))


async def wait_available(b: Balancer, n: int = N_REPLICAS) -> None:
    for _ in range(200):
        if sum(v.healthy for v in b.core.view.replicas.values()) >= n:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("replicas never became healthy at the balancer")


def prompt(prefix: int, suffix: int, n_prefix: int = 256, n_suffix: int = 32) -> str:
    return " ".join([f"sys{prefix}w{i}" for i in range(n_prefix)] + [f"u{suffix}w{i}" for i in range(n_suffix)])


async def complete(s: aiohttp.ClientSession, base: str, text: str | list[int], max_tokens: int = 4,
                   stream: bool = False, **extra: Any) -> tuple[int, dict[str, str], Any]:
    body = {"model": "skymesh-sim", "prompt": text, "max_tokens": max_tokens, "stream": stream, **extra}
    async with s.post(base + "/v1/completions", json=body) as r:
        data = await r.read()
        return r.status, dict(r.headers), data


async def test_shared_prefix_requests_land_on_their_dualmap_pair(cluster: Cluster) -> None:
    served: dict[int, set[str]] = {}
    async with aiohttp.ClientSession() as s:
        for group in range(6):
            for j in range(6):
                status, headers, _ = await complete(s, cluster.base, prompt(group, j))
                assert status == 200
                served.setdefault(group, set()).add(headers["X-Skymesh-Replica"])
    # each prefix group stays on at most its two candidates
    assert all(len(reps) <= 2 for reps in served.values()), served
    # and the groups do not all pile on one pair
    assert len(set().union(*served.values())) >= 3, served
    snap = cluster.balancer.core.view.snapshot()
    assert all(r["in_flight"] == 0 for r in snap["replicas"].values())


async def test_openai_shaped_errors_never_5xx(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as s:
        cases = [
            (b"{not json", 400),
            (b"[1, 2]", 400),
            (json.dumps({"model": "skymesh-sim"}).encode(), 400),
            (json.dumps({"model": "skymesh-sim", "prompt": "x", "max_tokens": -3}).encode(), 400),
            (json.dumps({"model": "other", "prompt": "x"}).encode(), 404),
            (json.dumps({"model": "skymesh-sim", "prompt": "x " * 3_000_000}).encode(), 413),
        ]
        for body, want in cases:
            async with s.post(cluster.base + "/v1/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == want, (body[:40], r.status)
                err = (await r.json())["error"]
                assert err["message"] and err["type"]
        async with s.post(cluster.base + "/v1/chat/completions",
                          json={"model": "skymesh-sim", "messages": "hi"}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "messages"
        # a forwarded request is taken only on the peer listener (mTLS), never on the client port
        async with s.post(cluster.base + "/v1/completions", json={"model": "skymesh-sim", "prompt": "x"},
                          headers={"X-Skymesh-Hop": "1", "X-Skymesh-Peer-Token": "wrong"}) as r:
            assert r.status == 403
            assert (await r.json())["error"]["code"] == "forward_on_client_port"


async def test_streaming_passthrough_and_chat(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as s:
        body = {"model": "skymesh-sim", "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(cluster.base + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = [ln for ln in (await r.text()).split("\n\n") if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        usage = [json.loads(e[6:]) for e in events[:-1] if json.loads(e[6:]).get("usage")]
        assert usage and usage[-1]["usage"]["completion_tokens"] == 5


async def test_queue_bound_gives_429_with_retry_after(tmp_path: Path) -> None:
    dead = {"r0": f"http://127.0.0.1:{free_port()}"}  # nothing listens: never available
    cfg = parse_config(one_region_config(dead, free_port(), free_port(), queue_bound=1))
    b = Balancer(cfg, "us-east-1")
    await b.start(port=0)
    base = f"http://127.0.0.1:{b.bound_port}"
    try:
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(complete(s, base, "a b c"))
            for _ in range(100):
                if b.core.view.queue_length == 1:
                    break
                await asyncio.sleep(0.02)
            status, headers, data = await complete(s, base, "d e f")
            assert status == 429
            assert int(headers["Retry-After"]) >= 1
            assert json.loads(data)["error"]["code"] == "queue_full"
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
        for _ in range(100):
            if b.core.view.queue_length == 0:
                break
            await asyncio.sleep(0.02)
        assert b.core.view.queue_length == 0  # the abandoned request left the queue
    finally:
        await b.stop()


async def _sample_replicas(b: Balancer, urls: dict[str, str], stop: asyncio.Event,
                           out: list[tuple[int, dict[str, tuple[int, int]], int]]) -> None:
    """(balancer queue before, {replica: (running, waiting)}, balancer queue after), every
    ~50 ms: the replicas' own view next to whether the balancer was holding requests."""
    from skymesh.balancer.prober import probe_replica

    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            before = b.core.view.queue_length
            res = await asyncio.gather(*(probe_replica(s, u, 1.0) for u in urls.values()))
            snap = {rid: (p.num_running, p.num_waiting) for rid, p in zip(urls, res, strict=True) if p.healthy}
            out.append((before, snap, b.core.view.queue_length))
            await asyncio.sleep(0.05)


def _overfilled_while_idle(sample: tuple[int, dict[str, tuple[int, int]], int]) -> bool:
    """A replica queues more than the dispatch budget while another sits idle and the
    balancer holds requests it could have sent there (before and after the sample)."""
    before, snap, after = sample
    if len(snap) < N_REPLICAS or before == 0 or after == 0:
        return False
    waiting = [w for _, w in snap.values()]
    idle = [rid for rid, (run, w) in snap.items() if run == 0 and w == 0]
    return max(waiting) > SELECTIVE_PUSH_BUDGET and bool(idle)


async def _stuck_report(s: aiohttp.ClientSession, b: Balancer, urls: dict[str, str]) -> str:
    """Each replica's own metrics page (its vllm:* lines) and the state and age of every
    request the balancer still tracks."""
    lines = ["48 requests not done in 60 s"]
    for rid, url in urls.items():
        try:
            async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                page = await r.text()
            vllm = [ln for ln in page.splitlines()
                    if ln.startswith(("vllm:num_requests", "vllm:kv_cache", "vllm:num_preemptions"))]
            lines.append(f"replica {rid}: " + "; ".join(vllm))
        except (aiohttp.ClientError, TimeoutError) as e:
            lines.append(f"replica {rid}: metrics unreadable ({e!r})")
    now = asyncio.get_running_loop().time()
    for request_id, (state, age) in sorted(b.core.view.ages(now).items(), key=lambda kv: -kv[1][1]):
        lines.append(f"request {request_id}: {state} for {age:.2f} s")
    lines.append("balancer: " + json.dumps(b.admin_status())[:4000])
    return "\n".join(lines)


async def test_selective_pushing_keeps_waiting_at_the_balancer(tmp_path: Path) -> None:
    # small KV caches so 4 replicas cannot hold 48 long requests at once
    procs, b, base = await start_cluster(
        tmp_path, time_scale=1.0, sim_extra=["--num-gpu-blocks", "64"], name="least_load",
        options={"dispatch_budget": SELECTIVE_PUSH_BUDGET},
    )
    try:
        await wait_available(b)
        urls = {r: i.url for r, i in b.replicas.items()}
        samples: list[tuple[int, dict[str, tuple[int, int]], int]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_replicas(b, urls, stop, samples))
        async with aiohttp.ClientSession() as s:
            try:
                results = await asyncio.wait_for(asyncio.gather(
                    *(complete(s, base, prompt(k, k, 200, 40), max_tokens=24) for k in range(48))
                ), 60)
            except TimeoutError:
                # a stuck request: fail with what is needed to tell why, instead of hanging
                stop.set()
                pytest.fail(await _stuck_report(s, b, urls))
        stop.set()
        await sampler
        assert all(st == 200 for st, _, _ in results)
        assert b.core.view.counters.completed == 48
        # the balancer held requests back: its queue was used...
        assert b.core.view.counters.dispatched == 48
        assert max(max(before, after) for before, _, after in samples) >= 10
        # ...and no replica kept a waiting queue while another sat idle and the balancer
        # held requests. One sample alone can catch the probe's own staleness (an idle
        # replica is seen by the balancer at its next probe, <= 50 ms later; a probe can
        # beat a pushed request to the replica): two samples in a row span a probe, and
        # then the balancer must have used the idle replica.
        for prev, cur in itertools.pairwise(samples):
            assert not (_overfilled_while_idle(prev) and _overfilled_while_idle(cur)), (prev, cur)
        assert all(v.in_flight == 0 and v.pending_prefill_tokens == 0 for v in b.core.view.replicas.values())
    finally:
        await b.stop()
        await asyncio.gather(*(p.stop() for p in procs.values()))


async def _stream_one(s: aiohttp.ClientSession, base: str, k: int) -> dict[str, Any]:
    body = {"model": "skymesh-sim", "prompt": prompt(k, k, 64, 8), "max_tokens": 40, "stream": True}
    got_bytes = False
    try:
        async with s.post(base + "/v1/completions", json=body) as r:
            if r.status != 200:
                return {"status": r.status, "started": False, "done": False, "error_event": False}
            text = ""
            async for chunk in r.content.iter_any():
                got_bytes = True
                text += chunk.decode()
            return {"status": 200, "started": got_bytes, "done": "data: [DONE]" in text,
                    "error_event": '"error"' in text}
    except aiohttp.ClientError:
        return {"status": -1, "started": got_bytes, "done": False, "error_event": False}


@pytest.mark.fault
async def test_kill_a_replica_mid_load_loses_no_unstarted_request(tmp_path: Path) -> None:
    procs, b, base = await start_cluster(tmp_path, time_scale=1.0, name="round_robin")
    try:
        await wait_available(b)
        async with aiohttp.ClientSession() as s:
            tasks = []
            for k in range(40):
                tasks.append(asyncio.create_task(_stream_one(s, base, k)))
                await asyncio.sleep(0.03)
                if k == 15:
                    await procs["r1"].kill()
            results = await asyncio.gather(*tasks)
        unstarted_failures = [r for r in results if not r["done"] and not r["started"]]
        assert unstarted_failures == []
        for r in results:
            # a request either finished, or it was cut after it had started streaming and
            # then got an explicit SSE error event
            assert r["done"] or (r["started"] and r["error_event"]), r
        assert all(v.in_flight == 0 and v.pending_prefill_tokens == 0 for v in b.core.view.replicas.values())
        assert b.core.view.queue_length == 0
        report_figures("replica_killed", requests=len(results), completed=sum(r["done"] for r in results),
                       cut_mid_stream_with_sse_error=sum(not r["done"] and r["error_event"] for r in results),
                       unstarted_lost=len(unstarted_failures),
                       retried=b.core.transitions[("placed", "queued")])
    finally:
        await b.stop()
        await asyncio.gather(*(p.stop() for p in procs.values()))


async def test_metrics_page_counts_dispatches_and_reads_load_at_scrape_time(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as s:
        for j in range(3):
            status, _, _ = await complete(s, cluster.base, prompt(0, j))
            assert status == 200
        async with s.get(cluster.base + "/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            page = await r.text()
    wanted = ("skymesh_dispatches_total", "skymesh_queue_length", "skymesh_replicas_available",
              "skymesh_replica_in_flight")
    m = parse_samples(page, wanted)
    assert m == {"skymesh_dispatches_total": 3.0, "skymesh_queue_length": 0.0,
                 "skymesh_replicas_available": float(N_REPLICAS), "skymesh_replica_in_flight": 0.0}
    assert page.count("skymesh_replica_in_flight{replica=") == N_REPLICAS
    assert "_created" not in page


async def test_cached_token_predictions_are_judged_against_the_replicas_usage(tmp_path: Path) -> None:
    """Replicas with --enable-prompt-tokens-details: each served single prompt whose answer
    carries usage is counted by how the policy's expected cached prefix compared with the
    replica's own count. The routing history over-predicts once the replica's cache is
    gone (reset here); a stream without usage is not counted."""
    procs, b, base = await start_cluster(tmp_path, time_scale=0.2, sim_extra=["--enable-prompt-tokens-details"],
                                         name="prefix_tree", chunk_tokens=16)
    ids = list(range(5000, 5100))  # token ids: the balancer and the stand-ins count the same tokens
    usage = {"stream_options": {"include_usage": True}}
    key = 'skymesh_cache_predictions_total{{cache_source="routing-history",result="{}"}}'
    try:
        await wait_available(b)
        async with aiohttp.ClientSession() as s:
            served = set()
            for _ in range(2):
                status, headers, _ = await complete(s, base, ids, max_tokens=2, stream=True, **usage)
                assert status == 200
                served.add(headers["X-Skymesh-Replica"])
            assert len(served) == 1
            holder = served.pop()
            status, _, _ = await complete(s, base, ids, max_tokens=2, stream=True)
            assert status == 200
            async with s.post(b.replicas[holder].url + "/reset_prefix_cache") as r:
                assert (await r.json()) == {"success": True}
            status, headers, body = await complete(s, base, ids, max_tokens=2)
            assert status == 200 and headers["X-Skymesh-Replica"] == holder
            assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            async with s.get(base + "/metrics") as r:
                page = await r.text()
        m = parse_samples(page, tuple(key.format(x) for x in ("within_block", "over", "under")))
        # first: nothing expected, nothing cached; second: the 6 full blocks both ways
        assert m == {key.format("within_block"): 2.0, key.format("over"): 1.0}
    finally:
        await b.stop()
        await asyncio.gather(*(p.stop() for p in procs.values()))
