"""Availability propagation: how long after a region's replicas fill up do its peers see it?

Brings the local 3-region mesh up (tiny-test replicas, real processes, delay proxies),
floods us-east-1 until every replica reports waiting requests, and polls (every 5 ms) each
us-east-1 replica's /metrics and each peer balancer's /admin/status. The delay per peer is
(first poll where the peer sees us-east-1 with 0 available replicas) − (first poll where
all us-east-1 replicas report waiting > 0). Bound from the design: 2 probe intervals +
the one-way latency of the link (+ polling resolution).

    .venv/bin/python -m benchmarks.propagation [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.balancer.prober import probe_replica  # noqa: E402
from skymesh.operations.up import Mesh  # noqa: E402
from skymesh.security.admin_auth import admin_headers  # noqa: E402
from tests.mesh_helpers import local_config_free_ports  # noqa: E402


async def trial(mesh: Mesh, s: aiohttp.ClientSession) -> dict[str, float]:
    src = mesh.cfg.region("us-east-1")
    urls = [r.url for r in src.replicas]
    peers = {r.name: r.balancer.listen.http_url for r in mesh.cfg.regions if r.name != "us-east-1"}
    t_full: float | None = None
    seen: dict[str, float] = {}
    stop = asyncio.Event()

    async def flood() -> None:
        conn = aiohttp.TCPConnector(local_addr=("127.1.0.9", 0), limit=0)
        async with aiohttp.ClientSession(connector=conn) as c:
            body = {"model": "skymesh-sim", "prompt": " ".join(f"f{time.time_ns()}w{k}" for k in range(1500)),
                    "max_tokens": 200}

            async def one(i: int) -> None:
                b = dict(body, prompt=body["prompt"] + f" {i}")
                async with c.post(src.balancer.listen.http_url + "/v1/completions", json=b) as r:
                    await r.read()

            # the balancer only offloads when nothing local is available; requests sent
            # straight to the replicas make them full without the balancer's help
            async def direct(u: str, i: int) -> None:
                b = dict(body, prompt=body["prompt"] + f" d{i}")
                async with c.post(u + "/v1/completions", json=b) as r:
                    await r.read()

            await asyncio.gather(*(direct(u, i) for u in urls for i in range(12)), *(one(i) for i in range(4)))

    flooder = asyncio.create_task(flood())
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 20 and len(seen) < len(peers):
        now = time.perf_counter()
        if t_full is None:
            res = await asyncio.gather(*(probe_replica(s, u, 1.0) for u in urls))
            if all(r.healthy and r.num_waiting > 0 for r in res):
                t_full = now
        for name, url in peers.items():
            if name in seen:
                continue
            async with s.get(url + "/admin/status", headers=admin_headers(mesh.admin_token)) as r:
                st = await r.json()
            p = st["peers"].get("us-east-1")
            if t_full is not None and p and p["replicas_available"] == 0:
                seen[name] = time.perf_counter() - t_full
        await asyncio.sleep(0.005)
    stop.set()
    await flooder
    return {k: round(v * 1000, 1) for k, v in seen.items()}


async def main(trials: int) -> None:
    data = local_config_free_ports(time_scale=1.0)
    for r in data["regions"]:
        for rep in r["replicas"]:
            rep["sim"]["profile"] = "tiny-test"
    tmp = Path(tempfile.mkdtemp(prefix="skymesh-prop-"))
    data["controller"]["state_path"] = str(tmp / "c.sqlite")
    mesh = Mesh.from_dict(data, tmp)
    await mesh.start()
    out = []
    try:
        await asyncio.sleep(2)
        async with aiohttp.ClientSession() as s:
            for _ in range(trials):
                out.append(await trial(mesh, s))
                await asyncio.sleep(3)  # drain
    finally:
        await mesh.stop()
    probe_ms = mesh.cfg.policy.probe_interval_s * 1000
    bounds = {p: round(2 * probe_ms + mesh.cfg.one_way_ms("us-east-1", p), 1) for p in ("eu-west-1", "ap-northeast-1")}
    print(json.dumps({"trials_ms": out, "bound_ms (2 probes + one-way)": bounds}, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    asyncio.run(main(ap.parse_args().trials))
