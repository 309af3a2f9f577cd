"""A region is a fleet, live: balancer CPU per proxied request and the region's requests/s
at saturation with 1, 2 and 3 active-active balancers over the same stand-in replicas.

Each variant is a fresh one-region mesh (`skymesh up`'s :class:`Mesh`: the us-east-1
region of configs/local.yaml on free ports, its three replicas fast ``tiny-test``
stand-ins, ``balancer.siblings`` giving 0, 1 or 2 further members behind the spreading
entry proxy at the region's advertised address). The variants run interleaved
(1, 2, 3, 1, 2, 3, ...) so the other load on the machine falls on all of them alike.

Per variant: (1) an idle window (the members' CPU with no requests: probes, heartbeats,
the 20 ms sibling channel), (2) an open-loop window at a moderate fixed rate through the
entry (the CPU per request, the ratio to one balancer is what the issue bounds), (3) for
the variants in ``--saturate``, a closed loop of many users (requests/s the region
proxies). The load generator runs in its own process (this module with ``--drive``);
this process holds the entry proxy and samples every replica's
``vllm:num_requests_waiting`` the whole time. CPU is user+system time from /proc.

    PYTHONPATH=. .venv/bin/python -m benchmarks.fleet_capacity --rounds 3 --json /tmp/fleet.json [--png FIG.png]
    PYTHONPATH=. .venv/bin/python -m benchmarks.fleet_capacity --replot /tmp/fleet.json --png FIG.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.bench.figures import fleet_figure, load_json
from skymesh.bench.loadgen import ReplicaWaitingSampler
from skymesh.bench.proxy_cost import cpu_seconds
from skymesh.operations.up import Mesh
from skymesh.security.admin_auth import admin_headers
from tests.mesh_helpers import local_config_free_ports

REGION = "us-east-1"
SOURCE = "127.1.0.7"  # a client inside us-east-1's source network


# ----------------------------------------------------------------------------- the load generator


async def drive(url: str, source: str, rate: float, users: int, duration_s: float, max_requests: int,
                max_tokens: int, connections: int) -> dict[str, Any]:
    """Open loop at ``rate`` requests/s (``users`` == 0) or a closed loop of ``users``;
    bounded by ``duration_s`` and ``max_requests`` both. Keep-alive connections: the entry
    spreads connections (round robin over the members), so ``connections`` of them."""
    lat: list[float] = []
    errors: dict[str, int] = {}
    started = 0
    t_end = time.perf_counter() + duration_s
    timeout = aiohttp.ClientTimeout(total=30)
    conn = aiohttp.TCPConnector(limit=connections, local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        async def one(i: int) -> None:
            body = {"model": "skymesh-sim", "prompt": f"user {i % 97} says hi", "max_tokens": max_tokens,
                    "stream": True}
            t0 = time.perf_counter()
            try:
                async with s.post(url + "/v1/completions", json=body) as r:
                    data = await r.read()
                    if r.status != 200 or b"[DONE]" not in data:
                        errors[str(r.status)] = errors.get(str(r.status), 0) + 1
                        return
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                return
            lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        if users == 0:
            tasks: list[asyncio.Task[None]] = []
            while started < max_requests and time.perf_counter() < t_end:
                due = t0 + started / rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                tasks.append(asyncio.create_task(one(started)))
                started += 1
            await asyncio.gather(*tasks)
        else:
            counter = iter(range(max_requests))

            async def user() -> None:
                nonlocal started
                for i in counter:
                    if time.perf_counter() >= t_end:
                        return
                    started += 1
                    await one(i)

            await asyncio.gather(*(user() for _ in range(users)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"served": len(lat), "started": started, "errors": errors, "wall_s": round(wall, 3),
            "rps": round(len(lat) / wall, 1),
            "p50_ms": round(statistics.median(lat) * 1000, 2) if lat else None,
            "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1000, 2) if lat else None,
            "driver_cpu_s": round(sum(os.times()[:2]), 3)}


async def run_driver(url: str, *, rate: float, users: int, duration_s: float, max_requests: int,
                     max_tokens: int, connections: int) -> dict[str, Any]:
    """The load generator in its own process; killed (by its PID) if it overruns."""
    cmd = [sys.executable, "-m", "benchmarks.fleet_capacity", "--drive", url, "--source", SOURCE,
           "--rate", str(rate), "--users", str(users), "--duration", str(duration_s),
           "--max-requests", str(max_requests), "--max-tokens", str(max_tokens), "--connections", str(connections)]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=duration_s + 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"driver exited {proc.returncode}: {err.decode()[-2000:]}")
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


# ----------------------------------------------------------------------------- the region


def region_config(balancers: int, time_scale: float, state: Path,
                  sibling_interval_s: float | None = None) -> dict[str, Any]:
    """us-east-1 of the local mesh (free ports), tiny-test stand-ins, ``balancers`` members
    (their sibling channel every ``sibling_interval_s``; None: the default)."""
    data = local_config_free_ports(time_scale=time_scale, siblings=balancers - 1)
    data["regions"] = data["regions"][:1]
    for rep in data["regions"][0]["replicas"]:
        rep["sim"]["profile"] = "tiny-test"
    data["latencies"] = []
    data["offload"]["rules"] = []
    data["controller"]["state_path"] = str(state / "controller.sqlite")
    if sibling_interval_s is not None:
        data["siblings"] = {"interval_s": sibling_interval_s}
    return data


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


async def members_ready(mesh: Mesh, within_s: float = 60.0) -> None:
    """Every member answers /admin/status and, with siblings, every replica's budget is held
    once over them (the sibling channel runs)."""
    region = mesh.cfg.region(REGION)
    headers = admin_headers(mesh.admin_token)
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=2)) as s:
        while time.monotonic() < deadline:
            seen: list[dict[str, Any]] = []
            for m in region.balancer_members:
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with s.get(m.listen.http_url + "/admin/status") as r:
                        if r.status == 200:
                            seen.append(dict(await r.json()))
            if len(seen) == len(region.balancer_members):
                if len(seen) == 1:
                    return
                held = [x.get("siblings", {}).get("units_held") for x in seen]
                if all(isinstance(h, dict) for h in held) and all(
                        sum(h.get(rep.id, 0) for h in held if h) == 2 for rep in region.replicas):
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the {len(region.balancer_members)} members of {REGION} never all ready")


def cpu_of(pids: list[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


async def one_variant(balancers: int, args: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    state = tmp / tag
    state.mkdir(parents=True)
    mesh = Mesh.from_dict(region_config(balancers, args.time_scale, state), state / "run")
    out: dict[str, Any] = {"balancers": balancers, "tag": tag}
    sampler: ReplicaWaitingSampler | None = None
    try:
        await mesh.start()
        await members_ready(mesh)
        region = mesh.cfg.region(REGION)
        entry = region.balancer.advertise_url
        members = [c.pid for c in mesh.balancer_members.values() if c.pid is not None]
        replicas = [c.pid for c in mesh.replicas.values() if c.pid is not None]
        others = [c.pid for c in (mesh.controller, mesh.dns) if c is not None and c.pid is not None]
        sampler = ReplicaWaitingSampler([rep.url.rstrip("/") for rep in region.replicas])
        sampler.start()
        # warm up (connections, first dispatches), then the idle cost
        await run_driver(entry, rate=args.rate, users=0, duration_s=2, max_requests=int(2 * args.rate),
                         max_tokens=args.max_tokens, connections=args.connections)
        await asyncio.sleep(1)
        c0 = cpu_of(members)
        await asyncio.sleep(args.idle_s)
        out["idle_cpu_per_s"] = round((cpu_of(members) - c0) / args.idle_s, 4)
        out["warmup_max_num_requests_waiting"] = sampler.take()

        async def window(name: str, **kw: Any) -> None:
            assert sampler is not None
            la0 = loadavg()
            st0 = await sibling_status(mesh)
            b0, r0, o0, e0 = cpu_of(members), cpu_of(replicas), cpu_of(others), self_cpu()
            res = await run_driver(entry, max_tokens=args.max_tokens, **kw)
            b1, r1, o1, e1 = cpu_of(members), cpu_of(replicas), cpu_of(others), self_cpu()
            st1 = await sibling_status(mesh)
            m0, m1 = ([int(x.get("messages_in", 0)) for x in st] for st in (st0, st1))
            served = max(1, res["served"])
            res.update(
                sibling_messages_sent_per_s_by_reason=messages_sent_by_reason(st0, st1, res["wall_s"]),
                # what each member applied of its siblings' messages, per second of the window
                sibling_messages_applied_per_s_per_member=[round((y - x) / res["wall_s"], 1)
                                                           for x, y in zip(m0, m1, strict=True)],
                balancers_cpu_s=round(b1 - b0, 3),
                cpu_us_per_request=round((b1 - b0) / served * 1e6, 1),
                # the members' idle CPU over the same wall time, taken off
                cpu_us_per_request_less_idle=round((b1 - b0 - out["idle_cpu_per_s"] * res["wall_s"]) / served * 1e6,
                                                   1),
                replicas_cpu_s=round(r1 - r0, 3), controller_dns_cpu_s=round(o1 - o0, 3),
                entry_and_sampler_cpu_s=round(e1 - e0, 3),
                loadavg_before=la0, loadavg_after=loadavg(), max_num_requests_waiting=sampler.take())
            out[name] = res

        await window("moderate", rate=args.rate, users=0, duration_s=args.duration,
                     max_requests=int(args.rate * args.duration), connections=args.connections)
        for rate in args.more_rates:
            await window(f"open_{rate:g}", rate=rate, users=0, duration_s=args.duration,
                         max_requests=int(rate * args.duration), connections=args.connections)
        if balancers in args.saturate:
            await window("saturation", rate=0, users=args.users, duration_s=args.duration,
                         max_requests=args.max_requests, connections=args.users)
        http = next(p for p in mesh.proxies if p.region == REGION and p.kind == "http")
        out["connections_by_member"] = [n for _, n in sorted(http.connections_by_target.items())]
        out["members_alive_at_end"] = all(c.running() for c in mesh.balancer_members.values())
    finally:
        if sampler is not None:
            await sampler.stop()
            out["max_num_requests_waiting"] = max(
                [sampler.take(), out.get("warmup_max_num_requests_waiting", 0.0),
                 *(out[w]["max_num_requests_waiting"] for w in ("moderate", "saturation") if w in out)])
            out["waiting_samples"] = sampler.samples
        await mesh.stop()
    return out


async def sibling_status(mesh: Mesh) -> list[dict[str, Any]]:
    """Per member, the ``siblings`` part of its /admin/status."""
    region = mesh.cfg.region(REGION)
    out = []
    async with aiohttp.ClientSession(headers=admin_headers(mesh.admin_token),
                                     timeout=aiohttp.ClientTimeout(total=5)) as s:
        for m in region.balancer_members:
            async with s.get(m.listen.http_url + "/admin/status") as r:
                out.append((await r.json()).get("siblings", {}))
    return out


def messages_sent_by_reason(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]],
                            wall_s: float) -> dict[str, float]:
    """Sibling messages sent per second per member over a window, by the reason that sent
    each (the channel's ``sent_<reason>`` counts: a protocol move, a page showing a
    change, a keepalive, ...), averaged over the members."""
    totals: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        cb, ca = b.get("channel", {}), a.get("channel", {})
        for key, n in ca.items():
            if key.startswith("sent_"):
                totals[key[5:]] = totals.get(key[5:], 0.0) + n - cb.get(key, 0)
    members = max(1, len(after))
    return {why: round(n / members / wall_s, 2) for why, n in sorted(totals.items()) if n}


async def idle_variant(balancers: int, interval_s: float, idle_s: float, tmp: Path, tag: str) -> dict[str, Any]:
    """The members' CPU and sibling messages applied per second, no requests at all."""
    state = tmp / tag
    state.mkdir(parents=True)
    mesh = Mesh.from_dict(region_config(balancers, 0.1, state, interval_s), state / "run")
    try:
        await mesh.start()
        await members_ready(mesh)
        region = mesh.cfg.region(REGION)
        pids = [c.pid for c in mesh.balancer_members.values() if c.pid is not None]

        async def applied(s: aiohttp.ClientSession) -> list[int]:
            out = []
            for m in region.balancer_members:
                async with s.get(m.listen.http_url + "/admin/status") as r:
                    out.append(int((await r.json())["siblings"].get("messages_in", 0)))
            return out

        async with aiohttp.ClientSession(headers=admin_headers(mesh.admin_token),
                                         timeout=aiohttp.ClientTimeout(total=5)) as s:
            await asyncio.sleep(1)
            a, c0, t0 = await applied(s), cpu_of(pids), time.monotonic()
            await asyncio.sleep(idle_s)
            b, c1, t1 = await applied(s), cpu_of(pids), time.monotonic()
        return {"balancers": balancers, "interval_s": interval_s, "tag": tag, "loadavg": loadavg(),
                "idle_cores_all_members": round((c1 - c0) / (t1 - t0), 3),
                "messages_applied_per_s_per_member": [round((y - x) / (t1 - t0), 1) for x, y in zip(a, b, strict=True)]}
    finally:
        await mesh.stop()


async def idle_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--idle-only``: the sibling channel's idle cost, interleaved over the balancer
    counts and the sibling intervals."""
    tmp = Path(tempfile.mkdtemp(prefix="skymesh-fleet-idle-"))
    res: dict[str, Any] = {"loadavg_start": loadavg(), "runs": []}
    try:
        for rnd in range(args.rounds):
            for n in args.variants:
                for iv in args.sibling_intervals:
                    r = await idle_variant(n, iv, args.idle_s, tmp, f"r{rnd}-b{n}-i{iv}")
                    print(json.dumps(r), file=sys.stderr, flush=True)
                    res["runs"].append(r)
    finally:
        res["loadavg_end"] = loadavg()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def top_processes() -> list[str]:
    done = subprocess.run(["ps", "-eo", "pid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True,
                          timeout=10)
    return [line[:160] for line in done.stdout.splitlines()[1:7]]


def summarize(runs: list[dict[str, Any]], variants: list[int], more_rates: Sequence[float] = ()) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    base = [r["moderate"]["cpu_us_per_request"] for r in runs if r["balancers"] == 1]
    base_less = [r["moderate"]["cpu_us_per_request_less_idle"] for r in runs if r["balancers"] == 1]
    for n in variants:
        mine = [r for r in runs if r["balancers"] == n]
        per = [r["moderate"]["cpu_us_per_request"] for r in mine]
        less = [r["moderate"]["cpu_us_per_request_less_idle"] for r in mine]
        s: dict[str, Any] = {
            "cpu_us_per_request": per, "median": statistics.median(per),
            "cpu_us_per_request_less_idle": less,
            "idle_cpu_per_s": [r["idle_cpu_per_s"] for r in mine],
            "max_num_requests_waiting": max(r["max_num_requests_waiting"] for r in mine),
        }
        # per round: this variant over the 1-balancer run of the same round
        s["ratio_to_1_per_round"] = [round(a / b, 3) for a, b in zip(per, base, strict=False)]
        s["ratio_to_1_median"] = round(statistics.median(per) / statistics.median(base), 3)
        s["ratio_to_1_less_idle_median"] = round(statistics.median(less) / statistics.median(base_less), 3)
        s["sibling_messages_applied_per_s_per_member"] = {
            f"{w}": [x for r in mine for x in r[w].get("sibling_messages_applied_per_s_per_member", [])]
            for w in ("moderate", *(f"open_{rate:g}" for rate in more_rates))}
        sat = [r["saturation"] for r in mine if "saturation" in r]
        if sat:
            s["saturation_rps"] = [x["rps"] for x in sat]
            s["saturation_cpu_us_per_request"] = [x["cpu_us_per_request"] for x in sat]
            s["saturation_balancer_cores"] = [round(x["balancers_cpu_s"] / x["wall_s"], 2) for x in sat]
        summary[str(n)] = s
    one_core = 1e6 / statistics.median(base)
    summary["projection"] = {
        "rps_per_balancer_core_from_moderate_1": round(one_core, 1),
        **{f"rps_at_{n}_balancer_cores": round(n * 1e6 / summary[str(n)]["median"], 1)
           for n in variants},
    }
    return summary


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="skymesh-fleet-"))
    res: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "drive"},
                           "loadavg_start": loadavg(), "top_start": top_processes(), "runs": []}
    try:
        for rnd in range(args.rounds):
            for n in args.variants:
                r = await one_variant(n, args, tmp, f"r{rnd}-b{n}")
                r["round"] = rnd
                print(json.dumps(r), file=sys.stderr, flush=True)
                res["runs"].append(r)
        res["summary"] = summarize(res["runs"], args.variants, args.more_rates)
    finally:
        res["loadavg_end"] = loadavg()
        res["top_end"] = top_processes()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", type=int, nargs="+", default=[1, 2, 3], help="balancers per region")
    p.add_argument("--saturate", type=int, nargs="*", default=[1, 2], help="variants also run at saturation")
    p.add_argument("--rate", type=float, default=100.0, help="moderate open-loop rate, requests/s")
    p.add_argument("--more-rates", type=float, nargs="*", default=[],
                   help="further open-loop windows at these rates, requests/s (sibling messages per rate)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per load window")
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--users", type=int, default=48, help="closed-loop users at saturation")
    p.add_argument("--max-requests", type=int, default=20000, help="cap per saturation window")
    p.add_argument("--connections", type=int, default=12, help="keep-alive connections at the moderate rate")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=0.1, help="the stand-ins' time scale (tiny-test)")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, metavar="PATH",
                   help="also draw the results page's figure (CPU per request and requests/s at saturation "
                        "against the balancers) to PATH")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="run nothing: draw --png from a --json this command wrote earlier")
    p.add_argument("--idle-only", action="store_true",
                   help="only the members' idle CPU and sibling messages, per --sibling-intervals")
    p.add_argument("--sibling-intervals", type=float, nargs="+", default=[0.02],
                   help="siblings.interval_s values for --idle-only")
    # the load generator's own process
    p.add_argument("--drive", default=None, help=argparse.SUPPRESS)
    p.add_argument("--source", default=SOURCE, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.drive:
        res = asyncio.run(drive(args.drive, args.source, args.rate, args.users, args.duration, args.max_requests,
                                args.max_tokens, args.connections))
        print(json.dumps(res), flush=True)
        return 0
    if args.replot:
        if not args.png:
            raise SystemExit("--replot: name the figure's file with --png PATH")
        print(f"wrote {fleet_figure(load_json(args.replot), Path(args.png))}")
        return 0
    if args.idle_only:
        idle = asyncio.run(idle_only(args))
        print(json.dumps(idle, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(idle, indent=2))
        return 0
    if 1 not in args.variants:
        raise SystemExit("--variants must include 1 (the baseline)")
    out = asyncio.run(main_async(args))
    text = json.dumps(out, indent=2)
    print(json.dumps(out["summary"], indent=2))
    if args.json:
        Path(args.json).write_text(text)
    if args.png:
        print(f"wrote {fleet_figure(out, Path(args.png))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
