"""The failover hand-back of the local 3-region mesh, seen by its clients: eu-west-1's
balancer is SIGKILLed, the controller fails it over (us-east-1 adopts its replicas, DNS
moves), then it is started again and the controller hands its replicas and its clients
back. From just before the restart until ``--after`` seconds after it, three bounded
client loops ask every ``--every`` seconds:

* ``eu_via_dns``: an EU client (127.2.x) at whatever the mesh name resolves to for it;
* ``eu_at_ap``: an EU client at ap-northeast-1's address (a client whose resolver or
  cache keeps it there; its residency allows only EU replicas, so AP must forward);
* ``eu_at_us``: an EU client at us-east-1's address (DNS cached from the failover);
* ``ap_via_dns``: an AP client (127.3.x) through DNS.

Prints one JSON line: per loop the statuses, each non-200 with its time after the
restart, Retry-After and message, and the first/last non-200 times.

    PYTHONPATH=. nice .venv/bin/python -m benchmarks.handback [--after 15]

Bounded: every loop stops by count and by time; the mesh is stopped on any exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

# the daemons this script starts read their admin and peer tokens from the env
os.environ.setdefault("SKYMESH_ADMIN_TOKEN", "skymesh-handback-admin-token")
os.environ.setdefault("SKYMESH_PEER_TOKEN", "skymesh-handback-peer-token")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.operations.up import Mesh  # noqa: E402
from tests.mesh_helpers import admin_auth, local_config_free_ports  # noqa: E402

US, EU, AP = "us-east-1", "eu-west-1", "ap-northeast-1"
# no loop runs longer than this, whatever happens to the restart
LIMIT_S = 90.0
SOURCES = {US: "127.1.0.7", EU: "127.2.0.7", AP: "127.3.0.7"}


def resolve(mesh: Mesh, source: str) -> str:
    import dns.message
    import dns.query

    assert mesh.cfg.dns.listen is not None
    q = dns.message.make_query(mesh.cfg.dns.name, "A")
    r = dns.query.udp(q, mesh.cfg.dns.listen.host, port=mesh.cfg.dns.listen.port, source=source, timeout=2)
    return str(r.answer[0][0].address)


def url_of(mesh: Mesh, ip: str) -> str:
    port = next(r.balancer.advertise.port for r in mesh.cfg.regions if r.balancer.advertise.host == ip)
    return f"http://{ip}:{port}"


async def ask(s: aiohttp.ClientSession, url: str, prompt: str) -> dict[str, Any]:
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": 4}
    try:
        async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            data = await r.json(content_type=None)
            err = data.get("error") if isinstance(data, dict) else None
            return {"status": r.status, "retry_after": r.headers.get("Retry-After"),
                    "message": err.get("message") if isinstance(err, dict) else None,
                    "path": r.headers.get("X-Skymesh-Path", "")}
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        return {"status": 0, "message": type(e).__name__}


async def loop(mesh: Mesh, name: str, source: str, target: str | None, t0: float, stop: asyncio.Event,
               every: float, max_n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    end = time.monotonic() + LIMIT_S
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(source, 0), limit=0,
                                                                    force_close=True)) as s:
        for i in range(max_n):
            if time.monotonic() >= end or stop.is_set():
                break
            ip = target or await asyncio.to_thread(resolve, mesh, source)
            res = await ask(s, url_of(mesh, ip), f"{name} asks {i}")
            res["t"] = round(time.monotonic() - t0, 2)
            res["at"] = ip
            out.append(res)
            await asyncio.sleep(every)
    return out


async def peer_view(mesh: Mesh, region: str, peer: str) -> dict[str, Any] | None:
    url = mesh.cfg.region(region).balancer.listen.http_url + "/admin/status"
    try:
        async with aiohttp.ClientSession(headers=admin_auth()) as s, \
                s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            st = await r.json()
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None
    p = st["peers"].get(peer)
    return None if p is None else {k: p[k] for k in ("available", "down", "staleness_s", "replicas_total")}


async def watch_peers(mesh: Mesh, t0: float, stop: asyncio.Event) -> list[dict[str, Any]]:
    """When us-east-1 and ap-northeast-1 see eu-west-1 available again (every 0.25 s)."""
    seen: list[dict[str, Any]] = []
    end = time.monotonic() + LIMIT_S
    while time.monotonic() < end and not stop.is_set():
        row = {"t": round(time.monotonic() - t0, 2), US: await peer_view(mesh, US, EU), AP: await peer_view(mesh, AP, EU)}
        if not seen or {k: v and v["available"] for k, v in row.items() if k != "t"} != \
                {k: v and v["available"] for k, v in seen[-1].items() if k != "t"}:
            seen.append(row)
        await asyncio.sleep(0.25)
    return seen


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    bad = [r for r in results if r["status"] != 200]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {"n": len(results), "statuses": statuses,
            "first_bad_s": bad[0]["t"] if bad else None, "last_bad_s": bad[-1]["t"] if bad else None,
            "bad": [{k: r.get(k) for k in ("t", "status", "at", "retry_after", "message")} for r in bad[:12]]}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--after", type=float, default=15.0, help="seconds to keep asking after the restarted balancer is ready")
    ap.add_argument("--every", type=float, default=0.2)
    ap.add_argument("--down", type=float, default=6.0, help="seconds eu-west-1 stays dead")
    ap.add_argument("--keep", type=Path, default=None, help="keep the mesh's state and logs in this folder")
    args = ap.parse_args()
    data = local_config_free_ports(time_scale=1.0)
    for r in data["regions"]:
        for rep in r["replicas"]:
            rep["sim"]["profile"] = "tiny-test"
    with tempfile.TemporaryDirectory() as scratch:
        tmp = str(args.keep or scratch)
        data["controller"]["state_path"] = str(Path(tmp) / "controller.sqlite")
        data["controller"]["probe_interval_s"] = 0.5
        data["controller"]["failure_threshold"] = 3
        data["dns"]["ttl_s"] = 1
        mesh = Mesh.from_dict(data, Path(tmp) / "run")
        await mesh.start()
        try:
            us_ip, ap_ip = (mesh.cfg.region(r).balancer.advertise.host for r in (US, AP))
            await asyncio.sleep(2.0)
            t_kill = time.monotonic()
            await mesh.stop_balancer(EU, kill=True)
            await asyncio.sleep(args.down)
            t0 = time.monotonic()
            stop = asyncio.Event()
            loops = asyncio.gather(
                loop(mesh, "eu_via_dns", SOURCES[EU], None, t0, stop, args.every, 400),
                loop(mesh, "eu_at_ap", SOURCES[EU], ap_ip, t0, stop, args.every, 400),
                loop(mesh, "eu_at_us", SOURCES[EU], us_ip, t0, stop, args.every, 400),
                loop(mesh, "ap_via_dns", SOURCES[AP], None, t0, stop, args.every, 400),
                watch_peers(mesh, t0, stop))
            await asyncio.sleep(0.5)
            t_restart = time.monotonic()
            await mesh.start_balancer(EU)
            ready_s = time.monotonic() - t_restart
            await asyncio.sleep(args.after)
            stop.set()
            eu_dns, eu_ap, eu_us, ap_dns, peers = await loops
            print(json.dumps({"killed_before_restart_s": round(t0 - t_kill, 2), "restart_at_s": round(t_restart - t0, 2),
                              "restart_ready_s": round(ready_s, 2),
                              "ready_at_s": round(t_restart - t0 + ready_s, 2), "eu_via_dns": summary(eu_dns),
                              "eu_at_ap": summary(eu_ap), "eu_at_us": summary(eu_us), "ap_via_dns": summary(ap_dns),
                              "eu_seen_available": peers}), flush=True)
        finally:
            await mesh.stop()


if __name__ == "__main__":
    asyncio.run(main())
