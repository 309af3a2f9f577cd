"""A region: its name, the client source networks that map to it, its balancer's
listeners and its replicas; and the one-way latency between two regions."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

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
from skymesh.config.network import DerivedHostPort, HostPortField, IpAddress, Network
from skymesh.config.replica import ReplicaConfig

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
        return self

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
        return self


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
