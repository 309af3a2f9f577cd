"""The controller's config reload (SIGHUP): what it applies live, what needs a restart.

Live: each region's replicas (membership: ownership is recomputed, the topology version
goes up and the new topology is pushed to every balancer watching), the DNS settings the
controller applies (balancers' ``public_ip``, ``aws_region``, and ``dns.ttl_s`` with
Route53), ``controller.probe_interval_s`` and ``failure_threshold``, latencies (who adopts
a dead region's replicas) and the admin token / metrics access.

Restart: the controller's own addresses and state file, the DNS provider and its name,
zone, endpoint and routing, the region set, the balancers' advertised addresses, the
entry's target groups and their endpoint, the policy name (the topology carries it), TLS files, the peer token. Settings only the
balancers or the DNS server read are reported as unused here (the embedded DNS server's
TTL is its own: restart it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from skymesh.config import MeshConfig, load_config_digest
from skymesh.runtime.reload_plan import (
    ANY,
    Kind,
    ReloadPlan,
    ReloadRefused,
    Rules,
    plan,
    run_reload,
)
from skymesh.security.admin_auth import resolve_admin_token

if TYPE_CHECKING:
    from controller.service import ControllerService

log = logging.getLogger("skymesh.controller.reload")


def controller_rules(dns_provider: str) -> Rules:
    """How a changed setting is taken by the controller (first match decides; a setting
    named by no rule needs a restart)."""
    return (
        (("regions", ANY, "replicas"), Kind.LIVE),
        (("regions", ANY, "aws_region"), Kind.LIVE),
        (("regions", ANY, "balancer", "public_ip"), Kind.LIVE),
        (("regions", ANY, "balancer", "advertise"), Kind.RESTART),
        (("regions", ANY, "balancer", "grpc_advertise"), Kind.RESTART),
        # the region's balancers: the members the controller probes and lists
        (("regions", ANY, "balancer", "siblings"), Kind.RESTART),
        # the entry's target groups and their API: the controller's client is made at start
        (("regions", ANY, "balancer", "entry_target_groups"), Kind.RESTART),
        (("regions", ANY, "balancer", "entry_endpoint_url"), Kind.RESTART),
        (("regions", ANY, "balancer"), Kind.UNUSED),  # listen addresses: the balancer's own
        (("regions", ANY, "source_networks"), Kind.UNUSED),  # the DNS server's and balancers'
        (("regions", ANY, "egress_source"), Kind.UNUSED),
        (("controller", "probe_interval_s"), Kind.LIVE),
        (("controller", "failure_threshold"), Kind.LIVE),
        # the embedded DNS server answers with its own TTL; Route53's records get it from here
        (("dns", "ttl_s"), Kind.LIVE if dns_provider == "route53" else Kind.UNUSED),
        (("latencies",), Kind.LIVE),
        (("local_latency_ms",), Kind.LIVE),
        (("admin",), Kind.LIVE),
        (("policy", "name"), Kind.RESTART),
        (("model",), Kind.UNUSED),
        (("policy",), Kind.UNUSED),
        (("offload",), Kind.UNUSED),
        (("health",), Kind.UNUSED),
        (("upstream",), Kind.UNUSED),
        (("client_auth",), Kind.UNUSED),
        (("slo_classes",), Kind.UNUSED),
        (("default_slo_class",), Kind.UNUSED),
        (("slo_early_rejection",), Kind.UNUSED),
        (("queue",), Kind.UNUSED),
        (("autoscaling",), Kind.UNUSED),  # the balancers publish the signal
        (("tracing",), Kind.UNUSED),  # the balancers' spans
        (("client_timeouts", "body_timeout_s"), Kind.UNUSED),  # header_timeout_s, http_limits: restart
        (("emulate_latency",), Kind.UNUSED),
    )


def controller_reload_plan(old_cfg: MeshConfig, new_cfg: MeshConfig) -> ReloadPlan:
    """What reloading ``new_cfg`` over ``old_cfg`` means for the controller. Pure."""
    return plan(old_cfg, new_cfg, controller_rules(old_cfg.dns.provider))


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    cfg: MeshConfig
    sha256: str
    admin_token: str | None


def load_controller_config(path: str | None, prepare: Callable[[MeshConfig], MeshConfig]) -> LoadedConfig:
    """Blocking: the file through the start-up loader, the command line's overrides
    (``prepare``, as at start) and the admin token."""
    cfg, digest = load_config_digest(path)
    cfg = prepare(cfg)
    return LoadedConfig(cfg, digest, resolve_admin_token(cfg))


async def reload_controller(svc: ControllerService, path: str | None,
                            prepare: Callable[[MeshConfig], MeshConfig]) -> bool:
    """One SIGHUP: load ``path`` in a thread, refuse it when a setting needs a restart,
    else apply it (and push the new topology when anything changed); logged and counted
    (skymesh_controller_config_reloads_total{result})."""

    async def apply(loaded: LoadedConfig) -> ReloadPlan:
        p = controller_reload_plan(svc.cfg, loaded.cfg)
        if p.needs_restart:
            raise ReloadRefused(p.needs_restart)
        token_changed = loaded.admin_token != svc.admin_token
        # nothing it reads changed (a token file aside): no new topology version
        await svc.apply_config(loaded.cfg, loaded.admin_token, config_sha256=loaded.sha256,
                               push=bool(p.changes))
        extra = ("admin (token)",) if token_changed and not any(c.startswith("admin") for c in p.changes) else ()
        return ReloadPlan((*p.changes, *extra), (), p.unused)

    return await run_reload(log, path, lambda: load_controller_config(path, prepare), apply,
                            lambda result: svc.metrics.config_reloads.labels(result).inc(), svc.reload_status)
