"""A key's limit holds through all of a region's balancers, live (docs/routing.md, "A region
is a fleet"): a client spread over both members by the region's entry gets the key's
requests a minute once, not once per member, because the members tell each other what each
key took over the sibling channel (the unit test is tests/test_shared_limits.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skymesh.operations.up import Mesh
from tests.mesh_helpers import report_figures
from tests.test_fleet import SOURCE, US, controller_status, http_entry, one_region_fleet
from tests.test_reload import sha

PER_MINUTE = 120  # alice's requests a minute
BURST = 2
OFFERED_PER_S = 6.0  # three times her limit
RUN_S = 30.0


@contextlib.asynccontextmanager
async def limited_fleet(tmp_path: Path) -> AsyncIterator[Mesh]:
    data = one_region_fleet(tmp_path)
    data["client_auth"] = {"keys": [{"name": "alice", "sha256": sha("sk-alice"),
                                     "limits": {"requests_per_second": PER_MINUTE / 60.0,
                                                "request_burst": BURST}}]}
    mesh = Mesh.from_dict(data, tmp_path / "run")
    await mesh.start()
    try:
        yield mesh
    finally:
        await mesh.stop()


async def ask(url: str) -> dict[str, Any]:
    """One completion as alice on its own connection: its status and, for a refusal, the
    OpenAI error object (0: the connection failed)."""
    body = {"model": "skymesh-sim", "prompt": "count me", "max_tokens": 4}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(SOURCE, 0), force_close=True),
                                         headers={"Authorization": "Bearer sk-alice"}) as s, \
                s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            data = await r.json(content_type=None)
            return {"status": r.status, "error": data.get("error") if isinstance(data, dict) else None}
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        return {"status": 0, "error": type(e).__name__}


async def offer(url: str) -> tuple[list[dict[str, Any]], float]:
    """Alice's requests at OFFERED_PER_S for RUN_S, each sent on time whatever the others
    do; the answers and the seconds from the first send to the last."""
    tasks: list[asyncio.Task[dict[str, Any]]] = []
    start = time.monotonic()
    n = int(RUN_S * OFFERED_PER_S)
    for i in range(n):
        await asyncio.sleep(max(0.0, start + i / OFFERED_PER_S - time.monotonic()))
        tasks.append(asyncio.create_task(ask(url)))
    elapsed = time.monotonic() - start
    return list(await asyncio.gather(*tasks)), elapsed


def admitted_and_checked(results: list[dict[str, Any]]) -> int:
    """How many were admitted; every other one is an OpenAI-shaped 429."""
    refused = [r for r in results if r["status"] != 200]
    assert all(r["status"] == 429 and isinstance(r["error"], dict) and r["error"].get("code") == "rate_limit_exceeded"
               and r["error"].get("message") for r in refused), [r for r in refused if r["status"] != 429][:3]
    return len(results) - len(refused)


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_a_keys_limit_holds_once_over_the_regions_balancers(tmp_path: Path) -> None:
    async with limited_fleet(tmp_path) as mesh:
        region = mesh.cfg.region(US)
        entry = http_entry(mesh)

        def both_alive(st: dict[str, Any] | None) -> bool:
            if st is None:
                return False
            us = next(r for r in st["regions"] if r["region"] == US)
            return [m["alive"] for m in us["balancers"]] == [True, True]

        for _ in range(300):  # hang guard
            if both_alive(await controller_status(mesh)):
                break
            await asyncio.sleep(0.1)
        assert both_alive(await controller_status(mesh))
        before = dict(entry.connections_by_target)

        # through the region's entry: connections spread over both members
        results, elapsed = await offer(region.balancer.advertise_url)
        spread = {f"{h}:{p}": entry.connections_by_target[(h, p)] - before[(h, p)] for h, p in before}
        assert all(n >= len(results) // 4 for n in spread.values()), spread
        via_entry = admitted_and_checked(results)
        limit = BURST + PER_MINUTE / 60.0 * elapsed
        assert abs(via_entry - limit) <= 0.1 * limit, (via_entry, limit)

        # the contrast: one member alone admits about the same
        await asyncio.sleep(BURST * 60.0 / PER_MINUTE)  # the bucket refills its burst
        alone_results, alone_elapsed = await offer(region.balancer_members[0].listen.http_url)
        alone = admitted_and_checked(alone_results)
        alone_limit = BURST + PER_MINUTE / 60.0 * alone_elapsed
        assert abs(alone - alone_limit) <= 0.1 * alone_limit, (alone, alone_limit)
        report_figures("fleet_key_limit", per_minute=PER_MINUTE, burst=BURST, offered_per_s=OFFERED_PER_S,
                       run_s=elapsed, limit=limit, admitted_via_entry=via_entry, refused_via_entry=len(results) - via_entry,
                       connections_per_member=spread, one_member_limit=alone_limit, admitted_by_one_member=alone)
