"""A burst after a quiet spell: does a balancer refuse its morning?

Brings the local 3-region mesh up (configs/local.yaml with free ports: stand-in replicas,
delay proxies, controller, DNS; real processes on loopback), then sends bursts of
``--burst`` small requests at once to one region's balancer, from a client address of that
region: one burst once the mesh is up, one after ``--idle-s`` seconds without a request,
one ``--again-s`` seconds after that. Per burst: the answers by HTTP status, the
Retry-After values of the refusals and the first refusal's message. Every process it
started is stopped (by PID) on the way out, also on failure or Ctrl-C.

    PYTHONPATH=. .venv/bin/python benchmarks/quiet_burst.py [--idle-s 90] [--burst 30]

Run the script by path with ``PYTHONPATH`` naming the checkout to measure: the mesh's
processes import skymesh from there too.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.operations.up import Mesh
from tests.mesh_helpers import local_config_free_ports

# bounds: the script's cost stays small whatever it is asked
MAX_BURST = 200
MAX_IDLE_S = 600.0
REQUEST_TIMEOUT_S = 60.0
# the balancer's probes need a few rounds after start before every replica is healthy
SETTLE_S = 3.0


async def burst(url: str, source_ip: str, n: int, tag: str) -> dict[str, Any]:
    """``n`` small completions sent together; what came back."""
    statuses: Counter[int] = Counter()
    retry_after: list[str] = []
    messages: list[str] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    conn = aiohttp.TCPConnector(local_addr=(source_ip, 0), limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:

        async def one(i: int) -> None:
            body = {"model": "skymesh-sim", "prompt": f"{tag} request {i}: say hello", "max_tokens": 8}
            try:
                async with s.post(url + "/v1/completions", json=body) as r:
                    text = await r.text()
                    statuses[r.status] += 1
                    if r.status != 200:
                        retry_after.append(r.headers.get("Retry-After", ""))
                        messages.append(text[:300])
            except (TimeoutError, aiohttp.ClientError) as e:
                statuses[0] += 1  # no answer
                messages.append(f"{type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - t0
    return {
        "sent": n,
        "served": statuses.get(200, 0),
        "refused_429": statuses.get(429, 0),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "retry_after": sorted(set(retry_after)),
        "first_refusal": messages[0] if messages else None,
        "seconds": round(elapsed, 2),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    data = local_config_free_ports(time_scale=1.0)
    tmp = Path(tempfile.mkdtemp(prefix="skymesh-quiet-burst-"))
    data["controller"]["state_path"] = str(tmp / "c.sqlite")
    mesh = Mesh.from_dict(data, tmp)
    region = mesh.cfg.region(args.region)
    url = region.balancer.listen.http_url
    # a client of that region: an address in its first source network
    source_ip = str(ipaddress.ip_network(str(region.source_networks[0]))[9])
    out: dict[str, Any] = {"region": args.region, "burst": args.burst, "idle_s": args.idle_s}
    await mesh.start()
    try:
        await asyncio.sleep(SETTLE_S)
        out["first"] = await burst(url, source_ip, args.burst, "first")
        await asyncio.sleep(args.idle_s)
        out["after_idle"] = await burst(url, source_ip, args.burst, "after-idle")
        await asyncio.sleep(args.again_s)
        out["again"] = await burst(url, source_ip, args.burst, "again")
    finally:
        await mesh.stop()
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--burst", type=int, default=30, help=f"requests per burst (at most {MAX_BURST})")
    ap.add_argument("--idle-s", type=float, default=90.0, help=f"the quiet spell (at most {MAX_IDLE_S:g} s)")
    ap.add_argument("--again-s", type=float, default=3.0, help="from the second burst to the third")
    ap.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = ap.parse_args()
    if not 1 <= args.burst <= MAX_BURST:
        ap.error(f"--burst must be 1..{MAX_BURST}")
    if not 0 <= args.idle_s <= MAX_IDLE_S or not 0 <= args.again_s <= MAX_IDLE_S:
        ap.error(f"--idle-s and --again-s must be 0..{MAX_IDLE_S:g}")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    figures = asyncio.run(main(arguments))
    text = json.dumps(figures, indent=2)
    print(text)
    if arguments.out is not None:
        arguments.out.write_text(text + "\n")
