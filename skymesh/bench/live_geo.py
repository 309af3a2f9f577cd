"""Live replay over the local 3-region mesh: `skymesh bench --trace FILE --regions 3 ...`.

For every system a whole mesh is started from the embedded default (``skymesh/local.yaml``:
us-east-1, eu-west-1, ap-northeast-1, their one-way latencies and the EU-stays-in-EU
offload rule) with ``--replicas`` stand-ins per region on free loopback ports: the
controller, the embedded DNS server, one balancer per region and the delay proxies that
make loopback feel like three regions. ``NAME`` runs policy NAME with cross-region
offload by predicted TTFT (skymesh), ``NAME@saturated`` by SkyWalker's rule, ``NAME@local``
the same with offload off (region-local); ``--no-eu-rule`` drops the residency rule.

Sessions (prefix chains) are assigned to regions and thinned by a diurnal curve per region
by the day's shape (skymesh/bench/day_shape.py), as in the discrete-event mode. Each request
is sent by a client *in* its region: from a source address inside the region's
``source_networks`` to the region's advertised balancer address, so it pays that link's
configured latency, and an offloaded request pays the inter-region one on the way out and
back, as in production.

Time scale: replicas run ``--time-scale`` times their profile's step times; the trace,
the SLO, the link latencies, the probe and heartbeat intervals are all scaled by the same
factor, so every ratio is the trace's.
"""

from __future__ import annotations

import argparse
import ipaddress
import uuid
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from skymesh.bench.day_shape import DayShape
from skymesh.bench.loadgen import (
    LiveResult,
    LoadSampler,
    ReplicaWaitingSampler,
    prefix_hit_rate,
    replay,
)
from skymesh.bench.sim_config import BENCH_QUEUE_BOUND
from skymesh.bench.sim_setup import replicas_per_region, split_system
from skymesh.bench.traces import TraceRequest
from skymesh.operations.up import Mesh
from skymesh.runtime.procs import free_port


def local_default() -> dict[str, Any]:
    """The packaged embedded default (``skymesh/local.yaml``) as a mapping."""
    return yaml.safe_load(resources.files("skymesh").joinpath("local.yaml").read_text())


def geo_mesh_config(policy: str, replicas: int | Mapping[str, int], profile: str, time_scale: float, slo_s: float,
                    offload: bool, state_dir: Path, trigger: str = "predicted_ttft",
                    residency: bool = True, balancers_per_region: int = 1) -> dict[str, Any]:
    """The embedded 3-region default with ``replicas`` stand-ins per region (one count for
    every region, or each region's own by name, every region named: a plan's layout),
    every port free, and every duration (latencies, probes, heartbeats, SLO) scaled;
    ``residency`` False drops its EU-stays-in-EU rule; ``balancers_per_region`` > 1 runs
    that many active-active balancers in each region behind its entry (balancer.siblings)."""
    data = local_default()
    names = [r["name"] for r in data["regions"]]
    counts = dict.fromkeys(names, replicas) if isinstance(replicas, int) else dict(replicas)
    if sorted(counts) != sorted(names) or any(n < 1 for n in counts.values()):
        raise ValueError(f"replicas: at least one for each of {', '.join(names)}, got {counts}")
    # the trace's prompts are word blocks (skymesh/word_tokenizer.py): the stand-ins below
    # count words, and the balancer hashes bytes as it did when the benchmarks were taken
    data.pop("tokenizer", None)
    for r in data["regions"]:
        b = r["balancer"]
        b["listen"] = f"127.0.0.1:{free_port()}"
        b["grpc_listen"] = f"127.0.0.1:{free_port()}"
        b["peer_listen"] = f"127.0.0.1:{free_port()}"
        for key in ("advertise", "grpc_advertise", "peer_advertise"):
            host = b[key].rsplit(":", 1)[0]
            b[key] = f"{host}:{free_port(host)}"
        b["siblings"] = [{"listen": f"127.0.0.1:{free_port()}", "grpc_listen": f"127.0.0.1:{free_port()}",
                          "peer_listen": f"127.0.0.1:{free_port()}"} for _ in range(balancers_per_region - 1)]
        prefix = r["replicas"][0]["id"].rsplit("-", 1)[0]
        r["replicas"] = [{"id": f"{prefix}-r{i}", "sim": {"profile": profile, "port": free_port(),
                                                         "time_scale": time_scale}}
                         for i in range(counts[r["name"]])]
    for link in data["latencies"]:
        link["one_way_ms"] = link["one_way_ms"] * time_scale
    data["local_latency_ms"] = data.get("local_latency_ms", 1) * time_scale
    data["controller"]["listen"] = f"127.0.0.1:{free_port()}"
    data["controller"]["http_listen"] = f"127.0.0.1:{free_port()}"
    data["controller"]["state_path"] = str(state_dir / "controller.sqlite")
    data["dns"]["listen"] = f"127.0.0.1:{free_port(span=2)}"  # the control endpoint is port + 1
    pol = data["policy"]
    pol.update(name=policy, ttft_slo_s=slo_s, queue_bound=BENCH_QUEUE_BOUND, chunk_tokens=512,
               probe_interval_s=pol.get("probe_interval_s", 0.1) * time_scale)
    off = data["offload"]
    off["enabled"] = offload
    off["trigger"] = trigger
    if not residency:
        off["rules"] = []
    off["heartbeat_interval_s"] = off.get("heartbeat_interval_s", 0.1) * time_scale
    return data


def client_sources(regions: Sequence[Any]) -> dict[str, str]:
    """A client address inside each region's first source network (not the balancer's
    egress address, so the delay proxy sees a client of that region)."""
    out = {}
    for r in regions:
        net = r.source_networks[0]
        out[r.name] = str(net.network_address + 10) if isinstance(net, ipaddress.IPv4Network) else str(
            net.network_address + 1)
    return out


def geo_regions() -> list[str]:
    """The local default's regions, in its order (the order the day's options name them)."""
    return [r["name"] for r in local_default()["regions"]]


def geo_layout(args: argparse.Namespace) -> dict[str, int]:
    """Replicas per region from ``--replicas`` and ``--region-replicas`` (``skymesh sim``'s
    syntax and meaning: named regions get their own count, the others ``--replicas``)."""
    return replicas_per_region(args, geo_regions())


def geo_trace(base: Sequence[TraceRequest], shape: DayShape, seed: int) -> list[TraceRequest]:
    """Sessions to the default's regions and per-region diurnal thinning by the day's
    shape, in trace time."""
    return shape.apply(base, geo_regions(), seed)


async def run_mesh_system(system: str, trace: Sequence[TraceRequest], args: argparse.Namespace,
                          tmp: Path, on_done: Any = None
                          ) -> tuple[list[LiveResult], float | None, list[tuple[float, dict[str, int]]], float]:
    """One system over a fresh 3-region mesh; returns the results, the replicas' prefix
    cache hit rate (read before the mesh stops), the balancers' per-replica load samples
    and the most requests any replica had waiting in its own queue
    (``vllm:num_requests_waiting``, sampled every 50 ms)."""
    policy, offload, trigger = split_system(system, "predicted_ttft")
    state = tmp / f"mesh-{system.replace('@', '-')}-{uuid.uuid4().hex[:8]}"
    data = geo_mesh_config(policy, geo_layout(args), args.profile, args.time_scale, args.slo * args.time_scale,
                           offload=offload, state_dir=state, trigger=trigger, residency=not args.no_eu_rule,
                           balancers_per_region=args.balancers_per_region)
    mesh = Mesh.from_dict(data, state, time_scale=args.time_scale)
    await mesh.start()
    try:
        entry = {r.name: r.balancer.advertise_url for r in mesh.cfg.regions}
        source = client_sources(mesh.cfg.regions)
        status = [m.listen.http_url + "/admin/status" for r in mesh.cfg.regions for m in r.balancer_members]
        waiting = ReplicaWaitingSampler([rep.url.rstrip("/") for r in mesh.cfg.regions for rep in r.replicas])
        waiting.start()
        try:
            async with LoadSampler(status, args.load_sample_s * args.time_scale, args.time_scale,
                                   admin_token=mesh.admin_token) as sampler:
                results = await replay(trace, lambda r: entry[r.region], args.timeout_s, on_done=on_done,
                                       source_for=lambda r: source[r.region])
        finally:
            await waiting.stop()
        hit = await prefix_hit_rate([rep.url for r in mesh.cfg.regions for rep in r.replicas])
        return results, hit, sampler.samples, waiting.take()
    finally:
        await mesh.stop()
