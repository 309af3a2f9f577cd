"""Build the DNS provider a config asks for."""

from __future__ import annotations

from skymesh.config import MeshConfig
from skymesh.dns.base import DnsProvider
from skymesh.dns.embedded import EmbeddedDnsProvider


def make_provider(cfg: MeshConfig) -> DnsProvider:
    if cfg.dns.provider == "embedded":
        return EmbeddedDnsProvider(cfg)
    if cfg.dns.provider == "route53":
        # lazy: boto3 only when dns.provider is route53
        from skymesh.dns.route53 import Route53Provider

        assert cfg.dns.hosted_zone is not None  # validated by the config loader
        return Route53Provider(
            zone_name=cfg.dns.hosted_zone,
            record_name=cfg.dns.name,
            ttl=cfg.dns.ttl_s,
            endpoint_url=cfg.dns.endpoint_url,
            failover=cfg.dns.routing == "failover",
        )
    raise ValueError(f"unknown DNS provider {cfg.dns.provider!r}")
