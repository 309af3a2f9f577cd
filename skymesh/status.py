"""`skymesh status [--config FILE] [--json] [--watch [S]]`: the mesh at a glance.

Asks the controller first (GET /v1/status); when it is down, asks each balancer's
/admin/status directly and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiohttp

from skymesh.config import ConfigError, MeshConfig, load_config


async def _get_json(s: aiohttp.ClientSession, url: str) -> Any | None:
    try:
        async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            if r.status == 200:
                return await r.json()
    except (TimeoutError, aiohttp.ClientError, OSError, json.JSONDecodeError):
        pass
    return None


async def collect(cfg: MeshConfig) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        status = await _get_json(s, cfg.controller.http_listen.http_url + "/v1/status")
        if status is not None:
            # fill in fresh balancer detail where the controller's last report is missing
            return status
        reports = await asyncio.gather(
            *(_get_json(s, r.balancer.listen.http_url + "/admin/status") for r in cfg.regions)
        )
    regions = []
    for r, rep in zip(cfg.regions, reports, strict=True):
        regions.append({
            "region": r.name,
            "balancer_alive": rep is not None,
            "balancer_id": rep.get("balancer_id", "") if rep else "",
            "balancer_url": r.balancer.advertise_url,
            "owned_replicas": [
                {"replica_id": rid, "url": x.get("url", ""), "home_region": x.get("home_region", r.name)}
                for rid, x in (rep or {}).get("replicas", {}).items()
            ],
            "report": rep,
        })
    return {"source": "balancers", "controller": None, "policy": cfg.policy.name, "regions": regions}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def render(status: dict[str, Any]) -> str:
    lines: list[str] = []
    if status["source"] == "controller":
        c = status["controller"]
        lines.append(f"controller: up (topology v{c['topology_version']}), policy {status.get('policy', '?')}")
    else:
        lines.append("controller: DOWN — showing what each balancer reports directly")
    healthy = sum(1 for r in status["regions"] if r["balancer_alive"])
    lines.append(f"regions: {healthy}/{len(status['regions'])} healthy")
    for r in status["regions"]:
        rep = r.get("report") or {}
        up = "up" if r["balancer_alive"] else "DOWN"
        lines.append("")
        lines.append(f"== {r['region']}  balancer {up}  {r.get('balancer_url', '')}  {r.get('balancer_id', '')}")
        if not r["balancer_alive"]:
            owner = r.get("nearest_alive")
            if owner and owner != r["region"]:
                lines.append(f"   replicas adopted by {owner}")
        owned = r.get("owned_replicas", [])
        if rep:
            reps = rep.get("replicas", {})
            avail = sum(1 for x in reps.values() if x.get("available"))
            lines.append(
                f"   replicas {avail}/{len(reps)} available   queue {rep.get('queue_length', 0)}   "
                f"offloaded out {rep.get('offloaded_out', 0)} / in {rep.get('offloaded_in', 0)}   "
                f"prefix hits {_pct(rep.get('prefix_hit_ratio', 0.0))}"
            )
            lines.append(f"   {'replica':<16}{'home':<16}{'health':<9}{'running':>8}{'waiting':>8}{'KV':>6}")
            homes = {o["replica_id"]: o["home_region"] for o in owned}
            for rid, x in sorted(reps.items()):
                home = homes.get(rid, x.get("home_region", r["region"]))
                health = ("avail" if x.get("available") else "busy") if x.get("healthy") else "down"
                lines.append(
                    f"   {rid:<16}{home:<16}{health:<9}{x.get('num_running', 0):>8}{x.get('num_waiting', 0):>8}"
                    f"{_pct(x.get('kv_cache_usage', 0.0)):>6}"
                )
        elif owned:
            lines.append("   owns: " + ", ".join(
                o["replica_id"] + ("" if o["home_region"] == r["region"] else f" (from {o['home_region']})")
                for o in owned))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local mesh)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    while True:
        status = asyncio.run(collect(cfg))
        nothing = status["source"] == "balancers" and not any(r["balancer_alive"] for r in status["regions"])
        if nothing:
            print("nothing is running: no controller at "
                  f"{cfg.controller.http_listen.http_url} and no balancer answered "
                  "(start the mesh with `make run` or `skymesh up`)", file=sys.stderr)
            if args.watch is None:
                return 1
        elif args.json:
            print(json.dumps(status, indent=2))
        else:
            if args.watch is not None:
                print("\x1b[2J\x1b[H", end="")
            print(render(status))
        if args.watch is None:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
