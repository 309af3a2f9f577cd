"""The balancer's state as one document: /admin/status (``skymesh status`` reads it) and
the typed fields of it the controller report carries (:class:`StatusReport`). Built from
what it is given; it reads nothing else of the balancer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from skymesh.balancer.membership import ReplicaInfo, prefix_hit_ratio
from skymesh.balancer.ports import VERSION, ReplicaStatus, StatusReport
from skymesh.routing.pairing.base import ROLES
from skymesh.routing.region import RegionCore


def count_by_role(replica_docs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """The region's replicas per prefill/decode role (every role named, 0 where none):
    ``replicas_by_role``, and of them ``healthy_by_role`` and ``available_by_role``."""
    counts: dict[str, dict[str, int]] = {k: dict.fromkeys(ROLES, 0)
                                         for k in ("replicas_by_role", "healthy_by_role", "available_by_role")}
    for doc in replica_docs.values():
        role = doc.get("role") or "both"
        counts["replicas_by_role"][role] += 1
        counts["healthy_by_role"][role] += bool(doc.get("healthy"))
        counts["available_by_role"][role] += bool(doc.get("healthy") and doc.get("available"))
    return counts


def build_status_report(*, now: float, core: RegionCore, replicas: Mapping[str, ReplicaInfo],
                        cache_source: Callable[[str], str], identity: Mapping[str, Any],
                        config: Mapping[str, Any], control: Mapping[str, Any],
                        kv_events: Mapping[str, Any]) -> StatusReport:
    """``identity``: region, balancer_id, epoch, policy; ``config``: the loaded file's
    digest, load time and last reload; ``control``: controller_connected,
    topology_version, siblings (the region's other balancers); ``kv_events``: per replica, its event stream and block index."""
    snap = core.view.snapshot()
    replica_docs = {}
    for rid, info in replicas.items():
        v = snap["replicas"].get(rid, {})
        replica_docs[rid] = {"url": info.url, "home_region": info.home_region, **v,
                             "cache_source": cache_source(rid),
                             # leaving membership: nothing new is sent to it (the controller's topology)
                             "draining": rid in core.local.draining}
    hit_ratio = round(prefix_hit_ratio(replicas.values()), 4)
    admin = {
        **identity,
        "version": VERSION,
        "config": dict(config),
        "queue_length": snap["queue_length"],
        "in_flight": snap["in_flight"],
        "offloaded_out": core.offloaded_out,
        "offloaded_in": core.offloaded_in,
        "prefix_hit_ratio": hit_ratio,
        "replicas": replica_docs,
        **count_by_role(replica_docs),
        "peers": core.offload.snapshot_state(now),
        **control,
        "counters": snap["counters"],
        "active_requests": snap["active_requests"],
        "transitions": snap["transitions"],
        "policy_stats": snap["policy"],
        "kv_events": dict(kv_events),
    }
    return StatusReport(
        queue_length=snap["queue_length"],
        offloaded_out=core.offloaded_out,
        offloaded_in=core.offloaded_in,
        prefix_hit_ratio=hit_ratio,
        replicas=tuple(
            ReplicaStatus(
                replica_id=rid,
                url=r["url"],
                healthy=r.get("healthy", False),
                available=r.get("available", False),
                num_running=r.get("num_running", 0),
                num_waiting=r.get("num_waiting", 0),
                kv_cache_usage=r.get("kv_cache_usage", 0.0),
                role=r.get("role", "both"),
            )
            for rid, r in replica_docs.items()
        ),
        admin=admin,
    )
