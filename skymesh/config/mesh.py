"""The whole mesh (:class:`MeshConfig`, the YAML document's root) and the checks that span
its sections: unique region names and loopback addresses, a latency for every pair of
regions, offload rules and SLO class names that refer to something configured, and a TLS
certificate for every region."""

from __future__ import annotations

import fnmatch
from typing import Annotated

from pydantic import Field, PrivateAttr, model_validator

from skymesh.config.autoscaling import AutoscalingConfig
from skymesh.config.base import (
    Bool,
    ConfigModel,
    ErrorCollector,
    Float,
    Text,
    first_repeat,
)
from skymesh.config.control_plane import ControllerConfig, DnsConfig
from skymesh.config.edge import ClientTimeoutsConfig, HttpLimitsConfig
from skymesh.config.membership import MembershipConfig
from skymesh.config.network import HostPort
from skymesh.config.pairing import PairingConfig
from skymesh.config.region import LatencyConfig, RegionConfig
from skymesh.config.routing import (
    HealthConfig,
    OffloadConfig,
    PolicyConfig,
    QueueConfig,
    TokenizerConfig,
    UpstreamConfig,
)
from skymesh.config.security import AdminConfig, ClientAuthConfig, PeerToken, TlsConfig
from skymesh.config.siblings import SiblingsConfig
from skymesh.config.slo import SloClassConfig, SloClassName
from skymesh.config.tracing import TracingConfig
from skymesh.source_networks import SourceNetworkTable


class MeshConfig(ConfigModel):
    model: Text = "skymesh-sim"
    # the model's tokenizer for token-true prefix hashing (default: UTF-8 byte chunks)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    regions: Annotated[tuple[RegionConfig, ...], Field(min_length=1)]
    # one-way latency for every pair of distinct regions
    latencies: tuple[LatencyConfig, ...] = ()
    # one-way latency from a client to the balancer of its own region
    local_latency_ms: Annotated[Float, Field(ge=0, le=1000)] = 1.0
    controller: ControllerConfig
    dns: DnsConfig
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    # the state messages between the balancers of one region (a region of several)
    siblings: SiblingsConfig = Field(default_factory=SiblingsConfig)
    # prefill/decode pairs: the rule that splits requests between the replicas' roles
    pairing: PairingConfig = Field(default_factory=PairingConfig)
    # the shared secret of forwarded requests and the DNS control API; no default is
    # shipped: $SKYMESH_PEER_TOKEN, this, or the local-mode file (skymesh/security/admin_auth.py)
    peer_token: PeerToken | None = None
    client_auth: ClientAuthConfig = Field(default_factory=ClientAuthConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    client_timeouts: ClientTimeoutsConfig = Field(default_factory=ClientTimeoutsConfig)
    http_limits: HttpLimitsConfig = Field(default_factory=HttpLimitsConfig)
    emulate_latency: Bool = True
    # mTLS credentials of the mesh (gRPC and peer forwards); None: gRPC and the peer
    # listeners only on loopback, without TLS
    tls: TlsConfig | None = None
    # SLO classes by name; a request names one in X-SLO-Class, else its API key's, else
    # default_slo_class (none configured: requests carry no class)
    slo_classes: dict[SloClassName, SloClassConfig] = Field(default_factory=dict)
    default_slo_class: SloClassName | None = None
    # Mooncake's early rejection: a request whose class's TTFT target no replica here or at a
    # peer can meet even at best is answered 429 at once; false: it is queued anyway
    slo_early_rejection: Bool = True
    # replicas that join and leave while serving (the controller's registration API, AWS)
    membership: MembershipConfig = Field(default_factory=MembershipConfig)
    # the region's autoscaling signal: a Prometheus gauge always, published to CloudWatch
    # with autoscaling.cloudwatch (skymesh/balancer/autoscaling_signal.py)
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    # OpenTelemetry traces of the balancers (OTLP/HTTP); off unless tracing.endpoint is set
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    # (a, b) with a < b -> one-way ms, built from `latencies` by the validator
    _latency_ms: dict[tuple[str, str], float] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _cross_checks(self) -> MeshConfig:
        # independent checks: each problem is reported, not only the first (ErrorCollector)
        errors = ErrorCollector()
        names = [region.name for region in self.regions]
        repeat = first_repeat(names)
        if repeat is not None:
            i, first = repeat
            errors.add(f"regions[{i}].name", f"duplicate region {names[i]!r} (also regions[{first}])")
        _check_unique_endpoints(self.regions, errors)
        self._latency_ms = _latency_table(self.latencies, self.regions, errors)
        for i, rule in enumerate(self.offload.rules):
            if not any(fnmatch.fnmatchcase(n, rule.source) for n in names):
                errors.add(f"offload.rules[{i}].from", f"pattern {rule.source!r} matches no configured region")
        _check_slo_class_names(self, errors)
        for path, name in self.membership.referenced_regions():
            if name not in names:
                errors.add(f"membership.{path}", f"unknown region {name!r}")
        for i, r in enumerate(self.regions):
            if not r.replicas and not self.membership.can_add_to(r.name):
                errors.add(f"regions[{i}].replicas", "a region without YAML replicas needs a membership "
                           "source that adds some (membership.registration or membership.aws)")
        if self.offload.enabled and len(self.regions) > 1:
            for i, r in enumerate(self.regions):
                if r.balancer.peer_listen is None:
                    errors.add(f"regions[{i}].balancer.peer_listen",
                               "is required when offload is enabled: peers forward requests to this "
                               "listener (mTLS), never to the client port")
        if self.dns.routing == "failover" and len(self.regions) != 2:
            errors.add("dns.routing", f"failover routing needs exactly 2 regions, the config has {len(self.regions)}")
        _check_tls_names_every_region(self, errors)
        errors.raise_found()
        return self

    @property
    def latency_ms(self) -> dict[tuple[str, str], float]:
        """One-way ms for every pair of distinct regions, keyed (a, b) with a < b."""
        return self._latency_ms

    def source_network_table(self) -> SourceNetworkTable:
        """(network, region) over every region's source_networks, most specific first."""
        return sorted(((n, r.name) for r in self.regions for n in r.source_networks),
                      key=lambda x: -x[0].prefixlen)

    def region(self, name: str) -> RegionConfig:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def one_way_ms(self, a: str, b: str) -> float:
        if a == b:
            return self.local_latency_ms
        return self._latency_ms[(a, b) if a < b else (b, a)]

    def rtt_ms(self, a: str, b: str) -> float:
        return 2 * self.one_way_ms(a, b)


def _check_tls_names_every_region(cfg: MeshConfig, errors: ErrorCollector) -> None:
    if cfg.tls is None:
        return
    names = [r.name for r in cfg.regions]
    for name in cfg.tls.balancers:
        if name not in names:
            errors.add(f"tls.balancers.{name}", f"unknown region {name!r}")
    for name in names:
        if name not in cfg.tls.balancers:
            errors.add("tls.balancers", f"missing the certificate of region {name!r}")


def _check_slo_class_names(cfg: MeshConfig, errors: ErrorCollector) -> None:
    known = cfg.slo_classes
    listed = ", ".join(sorted(known)) or "none configured"
    if cfg.default_slo_class is not None and cfg.default_slo_class not in known:
        errors.add("default_slo_class", f"unknown SLO class {cfg.default_slo_class!r} (slo_classes: {listed})")
    for i, key in enumerate(cfg.client_auth.keys):
        if key.slo_class is not None and key.slo_class not in known:
            errors.add(f"client_auth.keys[{i}].slo_class",
                       f"unknown SLO class {key.slo_class!r} (slo_classes: {listed})")


def _latency_table(
    latencies: tuple[LatencyConfig, ...], regions: tuple[RegionConfig, ...], errors: ErrorCollector
) -> dict[tuple[str, str], float]:
    names = {r.name for r in regions}
    table: dict[tuple[str, str], float] = {}
    for i, entry in enumerate(latencies):
        a, b = entry.regions
        unknown = [(j, name) for j, name in enumerate((a, b)) if name not in names]
        for j, name in unknown:
            errors.add(f"latencies[{i}].regions[{j}]", f"unknown region {name!r}")
        key = (a, b) if a < b else (b, a)
        if key in table:
            errors.add(f"latencies[{i}].regions", f"latency between {a} and {b} given twice")
        elif not unknown:
            table[key] = float(entry.one_way_ms)
    for i, ra in enumerate(regions):
        for rb in regions[i + 1 :]:
            key = (ra.name, rb.name) if ra.name < rb.name else (rb.name, ra.name)
            if key not in table:
                errors.add("latencies", f"missing one-way latency between {key[0]} and {key[1]}")
    return table


def _check_unique_endpoints(regions: tuple[RegionConfig, ...], errors: ErrorCollector) -> None:
    used: dict[tuple[str, int], str] = {}

    def claim(hp: HostPort, path: str) -> None:
        # only loopback addresses are known to share one machine (the local mesh);
        # 0.0.0.0:8000 on two different cloud hosts is fine
        if not hp.host.startswith("127.") and hp.host != "localhost":
            return
        key = (hp.host, hp.port)
        if key in used:
            errors.add(path, f"address {hp} is already used by {used[key]}")
            return
        used[key] = path

    for i, r in enumerate(regions):
        b = r.balancer
        claim(b.listen, f"regions[{i}].balancer.listen")
        claim(b.grpc_listen, f"regions[{i}].balancer.grpc_listen")
        if b.advertise != b.listen:
            claim(b.advertise, f"regions[{i}].balancer.advertise")
        if b.grpc_advertise != b.grpc_listen:
            claim(b.grpc_advertise, f"regions[{i}].balancer.grpc_advertise")
        if b.peer_listen is not None:
            claim(b.peer_listen, f"regions[{i}].balancer.peer_listen")
        if b.peer_advertise is not None and b.peer_advertise != b.peer_listen:
            claim(b.peer_advertise, f"regions[{i}].balancer.peer_advertise")
        for k, sib in enumerate(b.siblings):
            at = f"regions[{i}].balancer.siblings[{k}]"
            claim(sib.listen, f"{at}.listen")
            claim(sib.grpc_listen, f"{at}.grpc_listen")
            if sib.peer_listen is not None:
                claim(sib.peer_listen, f"{at}.peer_listen")
        for j, rep in enumerate(r.replicas):
            if rep.sim is not None:
                claim(HostPort(rep.sim.host, rep.sim.port), f"regions[{i}].replicas[{j}].sim.port")
