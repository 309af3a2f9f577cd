"""The balancer's config reload (SIGHUP): what it applies live, what needs a restart.

Live: client API keys and per-key limits (a key whose name and limits are unchanged keeps
its token buckets), the admin token and /metrics access, upstream timeouts, health
thresholds, the queue bound, the queue-wait bound, retries, offload rules and bounds,
source networks, the body timeout, and this region's replica list when the balancer runs
without a controller (with one, the controller's topology decides membership; the
controller reloads its own config and pushes it). The keys file and the admin token file
are read again on every reload, changed or not in the YAML.

Restart: everything else the balancer reads: this region's listen and advertise
addresses, the region set, the peers' addresses, the model, the policy and its knobs,
TLS files, the peer token, ... (:func:`reload_plan` refuses a file changing any of them
as a whole). Settings only other daemons read (``dns``, most of ``controller``, other
regions' replicas) are reported as unused here.

In-flight and queued requests continue; see :meth:`RegionCore.reconfigure` for which
decisions the new settings reach.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from skymesh.balancer.auth import ClientKeyring
from skymesh.balancer.gate import ClientGate
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.config import MeshConfig, load_config_digest
from skymesh.runtime.reload_plan import (
    ANY,
    Kind,
    ReloadPlan,
    ReloadRefused,
    ReloadStatus,
    Rules,
    plan,
    run_reload,
)
from skymesh.security.admin_auth import resolve_admin_token

log = logging.getLogger("skymesh.balancer.reload_rules")


def balancer_rules(region: str, *, own_replicas: bool) -> Rules:
    """How a changed setting is taken by ``region``'s balancer (first match decides; a
    setting named by no rule needs a restart)."""
    return (
        (("regions", region, "replicas"), Kind.LIVE if own_replicas else Kind.UNUSED),
        (("regions", region, "balancer", "public_ip"), Kind.UNUSED),  # DNS publishes it
        (("regions", region, "balancer"), Kind.RESTART),  # its own listen/advertise addresses
        (("regions", region, "egress_source"), Kind.RESTART),
        (("regions", ANY, "source_networks"), Kind.LIVE),  # where a client comes from
        (("regions", ANY, "replicas"), Kind.UNUSED),  # another region's balancer owns them
        (("regions", ANY, "egress_source"), Kind.UNUSED),
        (("regions", ANY, "aws_region"), Kind.UNUSED),
        (("regions", ANY, "balancer", "public_ip"), Kind.UNUSED),
        (("regions", ANY, "balancer", "listen"), Kind.UNUSED),  # peers are dialled at advertise
        (("regions", ANY, "balancer", "grpc_listen"), Kind.UNUSED),
        (("regions", ANY, "balancer", "peer_listen"), Kind.UNUSED),  # forwarded to at peer_advertise
        (("client_auth",), Kind.LIVE),
        # read per request: a reload's classes name the requests admitted after it
        (("slo_classes",), Kind.LIVE),
        (("default_slo_class",), Kind.LIVE),
        (("slo_early_rejection",), Kind.LIVE),
        (("admin",), Kind.LIVE),
        (("upstream",), Kind.LIVE),
        (("health",), Kind.LIVE),
        (("policy", "queue_bound"), Kind.LIVE),
        (("policy", "max_retries"), Kind.LIVE),
        (("offload", "rules"), Kind.LIVE),
        (("offload", "max_remote_queue"), Kind.LIVE),
        (("offload", "trigger"), Kind.LIVE),
        (("offload", "min_gain_s"), Kind.LIVE),
        (("offload", "heartbeat_miss_limit"), Kind.LIVE),
        (("client_timeouts", "body_timeout_s"), Kind.LIVE),
        (("controller", "listen"), Kind.RESTART),  # the balancer dials it
        (("controller",), Kind.UNUSED),
        (("dns",), Kind.UNUSED),
        (("membership",), Kind.UNUSED),  # the controller's sources; balancers follow its topology
        (("tracing",), Kind.RESTART),  # the exporter and sampler are built at start
    )


def reload_plan(old_cfg: MeshConfig, new_cfg: MeshConfig, region: str, *, own_replicas: bool = True) -> ReloadPlan:
    """What reloading ``new_cfg`` over ``old_cfg`` means for ``region``'s balancer: the
    changes it applies live, the ones needing a restart (then it applies none), and the
    ones it does not read. ``own_replicas``: it runs without a controller, so its replica
    list is the file's. Pure."""
    return plan(old_cfg, new_cfg, balancer_rules(region, own_replicas=own_replicas))


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A config file and what it points at, read and validated (off the event loop)."""

    cfg: MeshConfig
    sha256: str
    keyring: ClientKeyring
    admin_token: str | None


def load_balancer_config(path: str | None, prepare: Callable[[MeshConfig], MeshConfig]) -> LoadedConfig:
    """Blocking: the file through the start-up loader, ``prepare`` (the command line's
    overrides, as at start), the client keys (keys file, env) and the admin token."""
    cfg, digest = load_config_digest(path)
    cfg = prepare(cfg)
    return LoadedConfig(cfg, digest, ClientKeyring.from_config(cfg.client_auth), resolve_admin_token(cfg))


class Reloadable(Protocol):
    """What a reload needs of the balancer (skymesh.balancer.server.Balancer)."""

    @property
    def cfg(self) -> MeshConfig: ...

    @property
    def region(self) -> str: ...

    @property
    def gate(self) -> ClientGate: ...

    @property
    def metrics(self) -> BalancerMetrics: ...

    @property
    def reload_status(self) -> ReloadStatus: ...

    def apply_config(self, cfg: MeshConfig, keyring: ClientKeyring, admin_token: str | None, *,
                     own_replicas: bool, config_sha256: str | None) -> None: ...


async def reload_balancer(b: Reloadable, path: str | None, prepare: Callable[[MeshConfig], MeshConfig], *,
                          own_replicas: bool) -> bool:
    """One SIGHUP: load ``path`` in a thread, refuse it when a setting needs a restart,
    else apply it; logged and counted (skymesh_config_reloads_total{result})."""

    async def apply(loaded: LoadedConfig) -> ReloadPlan:
        p = reload_plan(b.cfg, loaded.cfg, b.region, own_replicas=own_replicas)
        if p.needs_restart:
            raise ReloadRefused(p.needs_restart)
        changes = list(p.changes)
        # files the YAML points at may have changed under an unchanged YAML
        if loaded.keyring.keys != b.gate.keyring.keys and not any(c.startswith("client_auth") for c in changes):
            changes.append("client_auth (keys from keys_file/keys_env)")
        if loaded.admin_token != b.gate.admin_token and not any(c.startswith("admin") for c in changes):
            changes.append("admin (token)")
        b.apply_config(loaded.cfg, loaded.keyring, loaded.admin_token, own_replicas=own_replicas,
                       config_sha256=loaded.sha256)
        return ReloadPlan(tuple(changes), (), p.unused)

    return await run_reload(log, path, lambda: load_balancer_config(path, prepare), apply,
                            lambda result: b.metrics.config_reloads.labels(result).inc(), b.reload_status)
