"""The soak: the local 3-region mesh under a steady, bounded, mixed load for
``SKYMESH_SOAK_S`` seconds (default 600). Not in ``make test``: run it with
``pytest -m soak -s tests/test_soak.py``. Balancer memory, prefix-trie sizes and the
in-flight counters must stay within their bounds; the figures are printed as one
``FIGURES {json}`` line (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skymesh.operations.up import Mesh
from tests.mesh_helpers import report_figures
from tests.test_mesh_integration import (
    REGION_SOURCES,
    admin,
    client_session,
    mesh_config,
    peers_ready,
    wait_for,
)

SOAK_S = float(os.environ.get("SKYMESH_SOAK_S", "600"))
TRIE_MAX_NODES = 4000  # small, so the soak runs the trie at its bound (evicting) most of the time
CONCURRENCY_PER_REGION = 4
# RSS may grow while caches, pools and the allocator warm up; after the first third of the
# run it must be flat within this (a leak of ~1 KB per request would exceed it)
RSS_GROWTH_BOUND_MB = 25.0

pytestmark = [pytest.mark.soak, pytest.mark.timeout(SOAK_S + 300)]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def user(mesh: Mesh, region: str, seed: int, until: float, counts: dict[str, int]) -> None:
    """One user: multi-turn conversations on a few shared system prompts, some streamed,
    some abandoned mid-stream (a client that leaves)."""
    rnd = random.Random(seed)
    url = mesh.cfg.region(region).balancer.advertise_url
    async with client_session(REGION_SOURCES[region]) as s:
        for conv in itertools.count():
            if time.monotonic() >= until:
                return
            history = f"system prompt {rnd.randrange(5)} " * 40
            for turn in range(rnd.randint(1, 4)):
                history += f" user {seed} conversation {conv} turn {turn} " * rnd.randint(5, 30)
                stream = rnd.random() < 0.5
                leave_early = stream and rnd.random() < 0.1
                body = {"model": "skymesh-sim", "prompt": history, "max_tokens": rnd.randint(4, 48), "stream": stream}
                try:
                    async with s.post(url + "/v1/completions", json=body,
                                      timeout=aiohttp.ClientTimeout(total=120)) as r:
                        counts[str(r.status)] = counts.get(str(r.status), 0) + 1
                        if leave_early:
                            await r.content.readany()
                            counts["left_early"] = counts.get("left_early", 0) + 1
                            continue  # the context manager closes the connection mid-stream
                        await r.read()
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1
                if time.monotonic() >= until:
                    return


async def test_soak_memory_tries_and_counters_stay_bounded(tmp_path: Path) -> None:
    data = mesh_config(tmp_path)
    data["policy"]["trie_max_nodes"] = TRIE_MAX_NODES
    mesh = Mesh.from_dict(data, tmp_path / "run")
    await mesh.start()
    samples: list[dict[str, Any]] = []
    try:
        await wait_for(lambda: peers_ready(mesh), 20, "peer heartbeats")
        t0 = time.monotonic()
        until = t0 + SOAK_S
        counts: dict[str, int] = {}
        users = [asyncio.create_task(user(mesh, region, 100 * k + i, until, counts))
                 for k, region in enumerate(REGION_SOURCES) for i in range(CONCURRENCY_PER_REGION)]
        with contextlib.suppress(TimeoutError):
            while time.monotonic() < until:
                sample: dict[str, Any] = {"t": time.monotonic() - t0}
                for region, child in mesh.balancers.items():
                    st = await admin(mesh, region)
                    assert st is not None and child.pid is not None
                    trie = st["policy_stats"].get("trie", {})
                    sample[region] = {"rss_mb": rss_mb(child.pid), "trie_nodes": trie.get("nodes", 0),
                                      "in_flight": st["in_flight"], "queue": st["queue_length"],
                                      "active": st["active_requests"]}
                    assert trie.get("nodes", 0) <= TRIE_MAX_NODES
                samples.append(sample)
                await asyncio.sleep(min(10.0, max(0.0, until - time.monotonic())))
        await asyncio.gather(*users)

        async def idle() -> bool:
            sts = [await admin(mesh, r) for r in REGION_SOURCES]
            return all(st is not None and st["in_flight"] == 0 and st["queue_length"] == 0
                       and st["active_requests"] == 0 for st in sts)

        await wait_for(idle, 30, "every balancer idle after the load")
        final = {r: await admin(mesh, r) for r in REGION_SOURCES}
    finally:
        await mesh.stop()
    served = counts.get("200", 0)
    assert served > 0
    assert not [k for k in counts if k.startswith("5")], counts  # no 5xx in the whole soak
    third = next(s for s in samples if s["t"] >= SOAK_S / 3)
    growth = {r: samples[-1][r]["rss_mb"] - third[r]["rss_mb"] for r in REGION_SOURCES}
    report_figures(
        "soak", duration_s=SOAK_S, answers=counts, samples=len(samples),
        rss_mb_start={r: round(samples[0][r]["rss_mb"], 1) for r in REGION_SOURCES},
        rss_mb_at_third={r: round(third[r]["rss_mb"], 1) for r in REGION_SOURCES},
        rss_mb_end={r: round(samples[-1][r]["rss_mb"], 1) for r in REGION_SOURCES},
        rss_growth_after_third_mb={r: round(g, 1) for r, g in growth.items()},
        trie_nodes_max={r: max(s[r]["trie_nodes"] for s in samples) for r in REGION_SOURCES},
        trie_bound=TRIE_MAX_NODES,
        in_flight_max={r: max(s[r]["in_flight"] for s in samples) for r in REGION_SOURCES},
        transitions_end={r: st["transitions"] for r, st in final.items() if st},
    )
    for r, g in growth.items():
        assert g <= RSS_GROWTH_BOUND_MB, f"{r} balancer RSS grew {g:.1f} MB after the first third"
