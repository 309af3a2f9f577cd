"""Dynamic membership (``membership:``): where replicas come from besides each region's
YAML ``replicas`` — the controller's registration API and AWS (Auto Scaling groups and
EC2 tags) — and how long a replica that leaves drains. Only the controller reads it; a
balancer started with ``--no-controller`` serves the YAML replicas alone."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from skymesh.config.base import Bool, ConfigError, ConfigModel, Float, Int, Port, Text, first_repeat
from skymesh.config.network import HttpUrlStr, Network
from skymesh.config.region import AwsRegion, RegionName
from skymesh.config.security import EnvVarName


class RegistrationConfig(ConfigModel):
    """The registration API on the controller's HTTP listener: a replica registers itself
    (``POST /membership/v1/replicas``) with a lease it renews by registering again, and
    deregisters (drains) with ``DELETE /membership/v1/replicas/<id>``."""

    enabled: Bool = False
    # the registration token (a bearer token of its own, not the admin token): the env
    # var first, then the file; with neither, every call answers 401
    token_env: EnvVarName = "SKYMESH_REGISTRATION_TOKEN"
    token_file: Text | None = None
    # the lease of a registration without its own ttl_s, and the longest one allowed
    default_ttl_s: Annotated[Float, Field(ge=1, le=86400)] = 30.0
    max_ttl_s: Annotated[Float, Field(ge=1, le=86400)] = 600.0
    # the largest registration body read (raw and decoded)
    max_body_bytes: Annotated[Int, Field(ge=256, le=65536)] = 4096
    # registered replicas in all (past it: 429)
    max_replicas: Annotated[Int, Field(ge=1, le=100_000)] = 1024
    # the regions replicas may register into (None: every configured region)
    regions: tuple[RegionName, ...] | None = None
    # the replica URL's host must be an IP address inside one of these (empty: any host)
    allowed_networks: tuple[Network, ...] = ()

    @model_validator(mode="after")
    def _ttls(self) -> RegistrationConfig:
        if self.default_ttl_s > self.max_ttl_s:
            raise ConfigError("default_ttl_s", f"{self.default_ttl_s:g} is above max_ttl_s ({self.max_ttl_s:g})")
        return self


class AwsGroupConfig(ConfigModel):
    """One Auto Scaling group whose InService instances are replicas of ``region``."""

    name: Annotated[Text, Field(max_length=255)]
    region: RegionName
    # the prefill/decode role of every replica the group runs (docs/routing.md, "Prefill
    # and decode pairs"): a P/D deployment runs a group per role
    role: Literal["both", "prefill", "decode"] = "both"


class AwsSourceConfig(ConfigModel):
    """Replicas discovered in one AWS region: the InService instances of Auto Scaling
    groups and/or running EC2 instances tagged ``<tag_key>=<skymesh region>``. A replica's
    id is its instance id, its URL ``<scheme>://<private IP>:<port>``."""

    aws_region: AwsRegion
    # an AWS API endpoint override (an emulator on loopback in tests); None: AWS
    endpoint_url: HttpUrlStr | None = None
    poll_interval_s: Annotated[Float, Field(ge=0.1, le=3600)] = 15.0
    port: Port = 8000
    scheme: Literal["http", "https"] = "http"
    # at most 100: one DescribeAutoScalingGroups call names them all
    auto_scaling_groups: Annotated[tuple[AwsGroupConfig, ...], Field(max_length=100)] = ()
    # e.g. "skymesh:region": running instances whose tag value names a configured region
    tag_key: Annotated[Text, Field(max_length=128)] | None = None

    @model_validator(mode="after")
    def _something_to_list(self) -> AwsSourceConfig:
        if not self.auto_scaling_groups and self.tag_key is None:
            raise ConfigError("", "name auto_scaling_groups, a tag_key, or both")
        repeat = first_repeat(g.name for g in self.auto_scaling_groups)
        if repeat is not None:
            i, first = repeat
            raise ConfigError(f"auto_scaling_groups[{i}].name",
                              f"group {self.auto_scaling_groups[i].name!r} is listed twice (also [{first}])")
        return self


class MembershipConfig(ConfigModel):
    """How replicas join and leave while serving (docs/deploy.md, "Replicas that join and leave")."""

    # a replica its source removed is published as draining this long (no new requests,
    # the ones in flight finish) before it is dropped; sooner once its balancer reports
    # nothing in flight on it
    drain_grace_s: Annotated[Float, Field(ge=0, le=3600)] = 30.0
    registration: RegistrationConfig = Field(default_factory=RegistrationConfig)
    aws: tuple[AwsSourceConfig, ...] = ()

    @model_validator(mode="after")
    def _one_source_per_aws_region(self) -> MembershipConfig:
        repeat = first_repeat((s.aws_region, s.endpoint_url) for s in self.aws)
        if repeat is not None:
            i, first = repeat
            raise ConfigError(f"aws[{i}].aws_region", f"{self.aws[i].aws_region} is listed twice (also aws[{first}])")
        return self

    def can_add_to(self, region: str) -> bool:
        """Whether a source may add replicas to ``region`` (registration open to it, an
        Auto Scaling group of it, or a tag key, whose values may name it)."""
        reg = self.registration
        if reg.enabled and (reg.regions is None or region in reg.regions):
            return True
        return any(s.tag_key is not None or any(g.region == region for g in s.auto_scaling_groups)
                   for s in self.aws)

    def referenced_regions(self) -> list[tuple[str, str]]:
        """(config path relative to ``membership``, region name) of every region it names."""
        out = [(f"registration.regions[{i}]", name) for i, name in enumerate(self.registration.regions or ())]
        for i, src in enumerate(self.aws):
            out += [(f"aws[{i}].auto_scaling_groups[{j}].region", g.region)
                    for j, g in enumerate(src.auto_scaling_groups)]
        return out
