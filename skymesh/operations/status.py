"""`skymesh status [--config FILE] [--json] [--watch [S]]`: the mesh at a glance.

Asks the controller first (GET /v1/status); a region whose balancer is alive but has no
report there yet is asked directly. When the controller is down, every balancer's
/admin/status is asked directly and the output says so. Nothing answering at all is a
clear message and exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.config import (
    HostPort,
    MeshConfig,
    RegionConfig,
    load_config_for_command,
)
from skymesh.operations.invocation import skymesh_command
from skymesh.security.admin_auth import DEFAULT_STATE_DIR, admin_headers, resolve_admin_token

_WILDCARDS = ("0.0.0.0", "::", "")


async def _get_json(s: aiohttp.ClientSession, url: str, refused: list[str] | None = None) -> Any | None:
    try:
        async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            if r.status == 200:
                return await r.json()
            if r.status == 401 and refused is not None:
                refused.append(url)  # it answered, but not to our (missing or wrong) admin token
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        pass
    return None


def _reachable(hp: HostPort) -> HostPort:
    return HostPort("127.0.0.1", hp.port) if hp.host in _WILDCARDS else hp


def balancer_admin_url(r: RegionConfig, member: int = 0) -> str:
    """Where to ask a balancer (the region's ``member``) directly: its own listen address
    (no delay proxy in the way), unless that is a wildcard; then the advertised one."""
    b = r.balancer
    listen = r.balancer_members[member].listen
    hp = b.advertise if listen.host in _WILDCARDS and b.advertise != listen else _reachable(listen)
    return hp.http_url + "/admin/status"


async def _member_reports(s: aiohttp.ClientSession, r: RegionConfig,
                          refused: list[str] | None = None) -> list[dict[str, Any] | None]:
    """Each balancer of the region's own /admin/status (None: no answer)."""
    answers = await asyncio.gather(*(_get_json(s, balancer_admin_url(r, m.index), refused)
                                     for m in r.balancer_members))
    return [a if isinstance(a, dict) else None for a in answers]


def controller_url(cfg: MeshConfig) -> str:
    return _reachable(cfg.controller.http_listen).http_url


def _from_balancer(r: RegionConfig, rep: dict[str, Any] | None,
                   member_reports: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """A region entry shaped like the controller's, from a balancer's own /admin/status
    (with ``member_reports``, each balancer's of a region of several)."""
    entry = {
        "region": r.name,
        "balancer_alive": rep is not None,
        "balancer_id": rep.get("balancer_id", "") if rep else "",
        "balancer_url": r.balancer.advertise_url,
        "owned_replicas": [
            {"replica_id": rid, "url": x.get("url", ""), "home_region": x.get("home_region", r.name),
             "role": x.get("role") or "both"}
            for rid, x in sorted((rep or {}).get("replicas", {}).items())
        ],
        "report": rep,
    }
    if member_reports is not None and len(member_reports) > 1:
        entry["balancers"] = [
            {"balancer_id": (x or {}).get("balancer_id") or m.id, "alive": x is not None,
             "epoch": (x or {}).get("epoch", 0), "http_url": m.listen.http_url}
            for m, x in zip(r.balancer_members, member_reports, strict=True)]
    return entry


async def collect(cfg: MeshConfig, admin_token: str | None = None,
                  state_dir: Path | None = DEFAULT_STATE_DIR) -> dict[str, Any]:
    """The mesh status: the controller's view (source "controller"), or each balancer's
    (source "balancers") when the controller does not answer. ``admin_token``: default
    from the config, the env or the local state dir (:mod:`skymesh.security.admin_auth`)."""
    token = admin_token or resolve_admin_token(cfg, state_dir)
    refused: list[str] = []
    async with aiohttp.ClientSession(headers=admin_headers(token)) as s:
        status = await _get_json(s, controller_url(cfg) + "/v1/status", refused)
        if isinstance(status, dict) and isinstance(status.get("regions"), list):
            # an alive balancer whose report has not reached the controller yet: ask it
            by_name = {r.name: r for r in cfg.regions}
            missing = [x for x in status["regions"]
                       if x.get("balancer_alive") and not x.get("report") and x.get("region") in by_name]
            fresh = await asyncio.gather(*(_member_reports(s, by_name[x["region"]]) for x in missing))
            for x, answers in zip(missing, fresh, strict=True):
                rep = next((a for a in answers if a is not None), None)
                if rep is not None:
                    x["report"] = rep
                    x["report_source"] = "balancer"
            status.setdefault("source", "controller")
            return status
        reports = await asyncio.gather(*(_member_reports(s, r, refused) for r in cfg.regions))
    # a region answers while any of its balancers does
    regions = [_from_balancer(r, next((a for a in answers if a is not None), None), answers)
               for r, answers in zip(cfg.regions, reports, strict=True)]
    return {"source": "balancers", "controller": None, "controller_url": controller_url(cfg),
            "policy": cfg.policy.name, "regions": regions, "unauthorized": refused}


def nothing_running(status: dict[str, Any]) -> bool:
    return status.get("source") != "controller" and not any(r.get("balancer_alive") for r in status["regions"])


# ----------------------------------------------------------------------------- rendering


def _pct(x: Any) -> str:
    try:
        return f"{100 * float(x):.0f}%"
    except (TypeError, ValueError):
        return "-"


def _num(x: Any) -> str:
    return "-" if x is None else str(x)


_ROLES = ("both", "prefill", "decode")


def _roles(rep: dict[str, Any], owned: list[dict[str, Any]]) -> dict[str, str]:
    """Each replica's prefill/decode role: as the balancer's report says, else as the
    controller's ownership does, else ``both`` (a balancer from before roles)."""
    by_owner = {o.get("replica_id"): o.get("role") for o in owned}
    return {rid: str(x.get("role") or by_owner.get(rid) or "both") for rid, x in rep.get("replicas", {}).items()}


def _roles_line(rep: dict[str, Any], roles: dict[str, str]) -> str:
    """Per role present, its available replicas of all: ``roles: prefill 1/2, decode 2/2 available``."""
    parts = []
    for role in _ROLES:
        reps = [x for rid, x in rep.get("replicas", {}).items() if roles[rid] == role]
        if reps:
            avail = sum(1 for x in reps if x.get("healthy", False) and x.get("available"))
            parts.append(f"{role} {avail}/{len(reps)}")
    return "   roles: " + ", ".join(parts) + " available"


def _replica_table(region: str, rep: dict[str, Any], owned: list[dict[str, Any]],
                   roles: dict[str, str]) -> list[str]:
    """One row per replica; a role column where the region has a replica that is not ``both``."""
    homes = {o.get("replica_id"): o.get("home_region") for o in owned}
    show_role = any(role != "both" for role in roles.values())
    rows = []
    for rid, x in sorted(rep.get("replicas", {}).items()):
        home = homes.get(rid) or x.get("home_region") or region
        if home != region:
            home = f"{home} (adopted)"
        if x.get("draining"):
            state = "drain"  # leaving membership: nothing new, in-flight requests finish
        elif not x.get("healthy", False):
            state = "down"
        else:
            state = "avail" if x.get("available") else "busy"
        # where the policy reads this replica's cache from: its KV events or the history
        cache = "events" if x.get("cache_source") == "events" else "history"
        rows.append((str(rid), str(home), roles[rid], state, _num(x.get("num_running")),
                     _num(x.get("num_waiting")), _pct(x.get("kv_cache_usage")), cache))
    w_id = max([len("replica"), *(len(r[0]) for r in rows)]) + 2
    w_home = max([len("home"), *(len(r[1]) for r in rows)]) + 2
    role_head = f"{'role':<9}" if show_role else ""
    lines = [f"   {'replica':<{w_id}}{'home':<{w_home}}{role_head}{'state':<7}{'running':>8}{'waiting':>8}{'KV':>6}  cache"]
    for rid, home, role, state, running, waiting, kv, cache in rows:
        role_cell = f"{role:<9}" if show_role else ""
        lines.append(f"   {rid:<{w_id}}{home:<{w_home}}{role_cell}{state:<7}{running:>8}{waiting:>8}{kv:>6}  {cache}")
    return lines


def _peers_line(peers: dict[str, Any]) -> str:
    parts = []
    for name, p in sorted(peers.items()):
        state = "avail" if p.get("available") else "unavail"
        if p.get("allowed") is False:
            state = "not allowed"
        rtt = p.get("rtt_ms")
        parts.append(f"{name} {state} ({_num(p.get('replicas_available'))}/{_num(p.get('replicas_total'))}, "
                     f"q {_num(p.get('queue_length'))}" + (f", rtt {rtt:g} ms" if isinstance(rtt, (int, float)) and rtt
                                                            else "") + ")")
    return "   peers: " + "; ".join(parts)


def _member_line(m: dict[str, Any]) -> str:
    """One balancer of a fleet: its id, state, epoch and own address."""
    state = "up" if m.get("alive") else ("DRAINING" if m.get("draining") else "DOWN")
    name = m.get("balancer_id") or m.get("key", "?")
    epoch = f"epoch {m['epoch']}" if m.get("epoch") else "not registered"
    return f"   balancer {name:<20} {state:<8} {epoch:<14} {m.get('http_url', '')}".rstrip()


def render(status: dict[str, Any]) -> str:
    """A table per region, from the shape :func:`collect` returns."""
    lines: list[str] = []
    if status.get("source") == "controller":
        c = status.get("controller") or {}
        lines.append(f"controller: up (topology v{c.get('topology_version', '?')}), "
                     f"policy {status.get('policy', '?')}")
    else:
        where = status.get("controller_url", "")
        lines.append(f"controller: DOWN{f' (no answer at {where})' if where else ''} — showing what each balancer "
                     "reports directly")
    regions = status.get("regions", [])
    healthy = sum(1 for r in regions if r.get("balancer_alive"))
    lines.append(f"regions: {healthy}/{len(regions)} healthy")
    for r in regions:
        rep = r.get("report") or {}
        name = r.get("region", "?")
        up = "up" if r.get("balancer_alive") else ("DRAINING" if r.get("balancer_draining") else "DOWN")
        lines.append("")
        members = r.get("balancers") or []
        if len(members) > 1:  # a fleet: how many of its balancers serve, then each
            alive = sum(1 for m in members if m.get("alive"))
            lines.append(f"== {name}  {alive}/{len(members)} balancers {up}  {r.get('balancer_url', '')}")
            lines += [_member_line(m) for m in members]
        else:
            lines.append(f"== {name}  balancer {up}  {r.get('balancer_url', '')}  {r.get('balancer_id', '')}".rstrip())
        if not r.get("balancer_alive"):
            owner = r.get("nearest_alive")
            if owner and owner != name:
                lines.append(f"   its replicas are adopted by {owner}")
            elif status.get("source") == "controller":
                lines.append("   no live balancer to adopt its replicas")
        owned = r.get("owned_replicas") or []
        if rep:
            reps = rep.get("replicas", {})
            avail = sum(1 for x in reps.values() if x.get("healthy", False) and x.get("available"))
            lines.append(
                f"   replicas {avail}/{len(reps)} available   queue {_num(rep.get('queue_length'))}   "
                f"offloaded out {_num(rep.get('offloaded_out'))} / in {_num(rep.get('offloaded_in'))}   "
                f"prefix hits {_pct(rep.get('prefix_hit_ratio'))}"
                + ("   (controller unreachable from it)" if rep.get("controller_connected") is False else "")
            )
            roles = _roles(rep, owned)
            if any(role != "both" for role in roles.values()):  # a region with P/D pools
                lines.append(_roles_line(rep, roles))
            lines += _replica_table(name, rep, owned, roles)
            if rep.get("peers"):
                lines.append(_peers_line(rep["peers"]))
        elif owned:
            lines.append("   owns: " + ", ".join(
                str(o.get("replica_id")) + ("" if o.get("home_region", name) == name
                                            else f" (adopted from {o.get('home_region')})")
                for o in owned))
        elif r.get("balancer_alive"):
            lines.append("   no report yet")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local mesh)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR),
                   help="where `skymesh up` keeps the local admin token (default .skymesh/run)")


def _nothing_message(cfg: MeshConfig, status: dict[str, Any] | None = None) -> str:
    if status and status.get("unauthorized"):
        return ("the mesh refused the admin token (401 from " + ", ".join(status["unauthorized"])
                + f"): set {cfg.admin.token_env}, admin.token_file, or --state-dir where `skymesh up` runs")
    return ("nothing is running: no controller at "
            f"{controller_url(cfg)} and no balancer answered at "
            + ", ".join(balancer_admin_url(r, m.index).removesuffix("/admin/status")
                         for r in cfg.regions for m in r.balancer_members)
            + f" (start the mesh with `make run` or `{skymesh_command()} up`)")


def _once(cfg: MeshConfig, args: argparse.Namespace) -> int:
    status = asyncio.run(collect(cfg, state_dir=Path(args.state_dir)))
    clear = "\x1b[2J\x1b[H" if args.watch is not None and not args.json and sys.stdout.isatty() else ""
    if nothing_running(status):
        if clear:
            print(clear, end="")
        print(_nothing_message(cfg, status), file=sys.stderr, flush=True)
        return 1
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True), flush=True)
    else:
        print(clear + render(status), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    cfg = load_config_for_command(args.config)
    if cfg is None:
        return 2
    if args.watch is None:
        return _once(cfg, args)
    interval = max(0.2, args.watch)
    try:
        while True:
            _once(cfg, args)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
