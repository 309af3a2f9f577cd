"""The mesh's control plane: the controller (health probes, topology, its status API) and
the DNS that sends clients to a healthy region (the embedded server or Route53)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from skymesh.config.base import ConfigError, ConfigModel, Float, Int, Text
from skymesh.config.network import DnsName, HostPortField, HttpUrlStr


class ControllerConfig(ConfigModel):
    listen: HostPortField  # gRPC
    http_listen: HostPortField  # JSON status for `skymesh status`
    state_path: Text = ".skymesh/controller.sqlite"
    probe_interval_s: Annotated[Float, Field(ge=0.05, le=600)] = 1.0
    failure_threshold: Annotated[Int, Field(ge=1, le=100)] = 3


class DnsConfig(ConfigModel):
    name: DnsName
    provider: Literal["embedded", "route53"] = "embedded"
    listen: HostPortField | None = None  # embedded server address
    ttl_s: Annotated[Int, Field(ge=1, le=86400)] = 5
    hosted_zone: Text | None = None  # route53
    # route53 API endpoint override (an emulator on loopback in tests); None: AWS
    endpoint_url: HttpUrlStr | None = None
    # route53 routing: "latency" (every region, nearest healthy answers) or "failover"
    # (exactly two regions: PRIMARY = first alive in config order, SECONDARY the other)
    routing: Literal["latency", "failover"] = "latency"

    @model_validator(mode="after")
    def _provider_needs(self) -> DnsConfig:
        if self.provider == "embedded" and self.listen is None:
            raise ConfigError("listen", "is required for the embedded DNS server")
        if self.provider == "route53" and self.hosted_zone is None:
            raise ConfigError("hosted_zone", "is required for provider route53")
        if self.routing == "failover" and self.provider != "route53":
            raise ConfigError("routing", "failover routing is a Route53 record type; use provider route53")
        return self
