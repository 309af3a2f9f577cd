"""A region: its name, the client source networks that map to it, its balancer's
listeners and its replicas; and the one-way latency between two regions."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from skymesh.config.base import (
    ConfigError,
    ConfigModel,
    Float,
    Text,
    first_repeat,
    matching,
    set_derived,
)
from skymesh.config.network import (
    DerivedHostPort,
    HostPort,
    HostPortField,
    HttpUrlStr,
    IpAddress,
    Network,
)
from skymesh.config.replica import REPLICA_ID_RE, ReplicaConfig

REGION_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{1,62}$")


RegionName = Annotated[
    Text,
    AfterValidator(matching(REGION_NAME_RE, "a lowercase region name like eu-west-1")),
    Field(json_schema_extra={"pattern": REGION_NAME_RE.pattern}),
]
AwsRegion = Annotated[
    Text, AfterValidator(matching(REGION_NAME_RE, "an AWS region")),
    Field(json_schema_extra={"pattern": REGION_NAME_RE.pattern}),
]
# a target group of an Elastic Load Balancing load balancer (its region is group 1); \Z:
# no trailing newline either
TARGET_GROUP_ARN_PATTERN = (r"^arn:aws(?:-[a-z]+)*:elasticloadbalancing:([a-z][a-z0-9-]{1,62}):[0-9]{12}:"
                            r"targetgroup/[A-Za-z0-9-]{1,32}/[0-9a-f]{16}$")
TARGET_GROUP_ARN_RE = re.compile(TARGET_GROUP_ARN_PATTERN[:-1] + r"\Z")
TargetGroupArn = Annotated[
    Text, AfterValidator(matching(TARGET_GROUP_ARN_RE, "a target group ARN "
                                  "(arn:aws:elasticloadbalancing:<region>:<account>:targetgroup/<name>/<id>)")),
    Field(json_schema_extra={"pattern": TARGET_GROUP_ARN_PATTERN}),
]
BalancerId = Annotated[
    Text,
    AfterValidator(matching(REPLICA_ID_RE, "letters, digits, '.', '_' or '-'")),
    Field(json_schema_extra={"pattern": REPLICA_ID_RE.pattern}),
]


@dataclass(frozen=True)
class BalancerMember:
    """One balancer of a region: its id and its own listeners (member 0 is the region's
    ``balancer:`` itself, member K its ``siblings[K-1]``)."""

    index: int
    id: str
    listen: HostPort
    grpc_listen: HostPort
    peer_listen: HostPort | None


class SiblingBalancerConfig(ConfigModel):
    """A further active-active balancer of the region: its own listeners behind the
    region's advertised addresses (an NLB in the cloud, `skymesh up`'s spreading proxies
    on loopback)."""

    # default: <region>-b<K>
    id: BalancerId | None = None
    listen: HostPortField
    grpc_listen: HostPortField
    peer_listen: HostPortField | None = None


class BalancerConfig(ConfigModel):
    listen: HostPortField  # HTTP (OpenAI API, admin, metrics)
    grpc_listen: HostPortField  # balancer<->balancer heartbeats
    # what clients, peers and DNS use (default: listen / grpc_listen). With
    # emulate_latency, `skymesh up` puts a delay proxy on these addresses in front of
    # `listen` / `grpc_listen`.
    advertise: DerivedHostPort = Field(default=None, description="default: listen")
    grpc_advertise: DerivedHostPort = Field(default=None, description="default: grpc_listen")
    # the address DNS publishes for clients (a public IP in the cloud); None: advertise host
    public_ip: IpAddress | None = None
    # HTTPS listener for peer balancers' forwarded requests only (mTLS under the mesh CA
    # with tls set; plain HTTP on loopback without it); forwards are refused on `listen`.
    # Required in a mesh that offloads (more than one region, offload enabled).
    peer_listen: HostPortField | None = None
    # where peers send their forwards (default: peer_listen); a delay proxy with
    # emulate_latency, like advertise
    peer_advertise: DerivedHostPort = Field(default=None, description="default: peer_listen")
    # further balancers of the region (a fleet): every one serves the advertised
    # addresses above, which must then be an entry in front of them all
    siblings: tuple[SiblingBalancerConfig, ...] = ()
    # who the region's balancers are: "listed", the config's (this section, member 0, and
    # its siblings); "registered", whoever registers with the controller (an Auto Scaling
    # group): every balancer is a member of its own, named by its own id (--balancer-id,
    # SKYMESH_BALANCER_ID, else the EC2 instance id) at its own reachable address
    # (--advertise-host, SKYMESH_ADVERTISE_HOST, else the instance's private IPv4); the
    # listeners here are each instance's, the advertised addresses the region's entry
    fleet: Literal["listed", "registered"] = "listed"
    # the region's entry on AWS: the target groups (ARNs, in the region's aws_region) of the
    # load balancers in front of its balancers. The controller takes a member named by an
    # EC2 instance id out of every one when it is dead or draining, and puts it back when
    # it is alive (controller/entry_targets.py), sooner than the groups' own health checks
    entry_target_groups: Annotated[tuple[TargetGroupArn, ...], Field(max_length=20)] = ()
    # the Elastic Load Balancing API endpoint override (an emulator on loopback in tests); None: AWS
    entry_endpoint_url: HttpUrlStr | None = None

    @model_validator(mode="after")
    def _advertise_defaults_to_listen(self) -> BalancerConfig:
        if self.advertise is None:
            set_derived(self, "advertise", self.listen)
        if self.grpc_advertise is None:
            set_derived(self, "grpc_advertise", self.grpc_listen)
        if self.peer_advertise is None:
            set_derived(self, "peer_advertise", self.peer_listen)
        elif self.peer_listen is None:
            raise ConfigError("peer_advertise", "needs peer_listen (the listener it reaches)")
        if self.fleet == "registered" and self.siblings:
            raise ConfigError("siblings", "a registered fleet lists no balancer: each one registers itself")
        if self.siblings or self.fleet == "registered":
            self._check_fleet_entry()
        repeat = first_repeat(self.entry_target_groups)
        if repeat is not None:
            i, first = repeat
            raise ConfigError(f"entry_target_groups[{i}]", f"listed twice (also [{first}])")
        if self.entry_endpoint_url is not None and not self.entry_target_groups:
            raise ConfigError("entry_endpoint_url", "names the API of entry_target_groups, and there are none")
        return self

    def _check_fleet_entry(self) -> None:
        """Several balancers: each advertised address is an entry in front of them all,
        never one balancer's own listener; each has a peer listener when the first has."""
        for advertised, listener in (("advertise", "listen"), ("grpc_advertise", "grpc_listen"),
                                     ("peer_advertise", "peer_listen")):
            if getattr(self, listener) is not None and getattr(self, advertised) == getattr(self, listener):
                raise ConfigError(advertised, f"a region with siblings needs an entry address in front of "
                                              f"all its balancers, not the first balancer's {listener} "
                                              f"({getattr(self, listener)})")
        for i, sib in enumerate(self.siblings):
            if (sib.peer_listen is None) != (self.peer_listen is None):
                which = "this sibling has one and the first balancer has none" if self.peer_listen is None \
                    else "the region's first balancer has one: every balancer of the region needs its own"
                raise ConfigError(f"siblings[{i}].peer_listen", which)

    def members(self, region: str) -> tuple[BalancerMember, ...]:
        """Every balancer of ``region``: member 0 (this section's listeners), then the
        siblings; ids ``<region>-b<K>`` unless given."""
        first = BalancerMember(0, f"{region}-b0", self.listen, self.grpc_listen, self.peer_listen)
        return (first, *(BalancerMember(k, sib.id or f"{region}-b{k}", sib.listen, sib.grpc_listen, sib.peer_listen)
                         for k, sib in enumerate(self.siblings, start=1)))

    @property
    def advertise_url(self) -> str:
        return self.advertise.http_url


class RegionConfig(ConfigModel):
    name: RegionName
    source_networks: Annotated[tuple[Network, ...], Field(min_length=1)]
    balancer: BalancerConfig
    # the YAML's replicas; empty only when a membership source can add some (mesh.py)
    replicas: tuple[ReplicaConfig, ...] = ()
    aws_region: AwsRegion | None = None
    # source address this region's balancer binds when it connects to peers, so a delay
    # proxy (or a real network) can tell which region traffic comes from
    egress_source: IpAddress | None = None

    @model_validator(mode="after")
    def _check(self) -> RegionConfig:
        repeat = first_repeat(rep.id for rep in self.replicas)
        if repeat is not None:
            i, first = repeat
            raise ConfigError(
                f"replicas[{i}].id", f"duplicate replica id {self.replicas[i].id!r} (also at index {first})"
            )
        if self.egress_source is not None:
            egress = ipaddress.ip_address(self.egress_source)
            if not any(egress in net for net in self.source_networks):
                raise ConfigError(
                    "egress_source", f"{self.egress_source} is not inside this region's source_networks"
                )
        ids = [m.id for m in self.balancer_members]
        repeat = first_repeat(ids)
        if repeat is not None:
            i, first = repeat
            raise ConfigError(f"balancer.siblings[{i - 1}].id",
                              f"duplicate balancer id {ids[i]!r} (also member {first} of this region)")
        self._check_entry_target_groups()
        return self

    def _check_entry_target_groups(self) -> None:
        """The entry's target groups are in the region's own AWS region (the controller's
        Elastic Load Balancing client is that region's)."""
        groups = self.balancer.entry_target_groups
        if groups and self.aws_region is None:
            raise ConfigError("balancer.entry_target_groups", "needs the region's aws_region (where the groups are)")
        for i, arn in enumerate(groups):
            m = TARGET_GROUP_ARN_RE.match(arn)
            if m is not None and m.group(1) != self.aws_region:
                raise ConfigError(f"balancer.entry_target_groups[{i}]",
                                  f"is in {m.group(1)}, not the region's aws_region {self.aws_region}")

    @property
    def balancer_members(self) -> tuple[BalancerMember, ...]:
        """The region's balancers: member 0 (``balancer:``) and its siblings."""
        return self.balancer.members(self.name)


class LatencyConfig(ConfigModel):
    """One-way latency between two regions (symmetric)."""

    regions: tuple[Text, ...]
    one_way_ms: Annotated[Float, Field(ge=0, le=10_000)]

    @model_validator(mode="after")
    def _two_regions(self) -> LatencyConfig:
        if len(self.regions) != 2:
            raise ConfigError("regions", f"expected two region names, got {len(self.regions)}")
        if self.regions[0] == self.regions[1]:
            raise ConfigError("regions", "a latency needs two different regions")
        return self
