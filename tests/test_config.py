"""Config loading: the shipped configs load; every bad config names its exact path."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from skymesh.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent
PROFILES = {"l4-llama3.1-8b", "h100-qwen2.5-7b"}


def base() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())


def test_embedded_default_loads_three_regions() -> None:
    cfg = load_config(None)
    assert [r.name for r in cfg.regions] == ["us-east-1", "eu-west-1", "ap-northeast-1"]
    assert all(len(r.replicas) == 3 for r in cfg.regions)
    assert cfg.rtt_ms("us-east-1", "eu-west-1") == 80
    assert cfg.rtt_ms("ap-northeast-1", "eu-west-1") == 220
    # GDPR-style rule: EU regions only offload inside the EU
    assert not cfg.offload.allowed("eu-west-1", "us-east-1")
    assert cfg.offload.allowed("us-east-1", "eu-west-1")


def test_configs_dir_local_is_the_embedded_default() -> None:
    assert load_config(ROOT / "configs" / "local.yaml") == load_config(None)


def test_aws_example_loads() -> None:
    cfg = load_config(ROOT / "configs" / "aws-3-regions.yaml")
    assert cfg.dns.provider == "route53"
    assert all(r.replicas and r.replicas[0].sim is None for r in cfg.regions)


def _set(d: dict[str, Any], path: list[Any], value: Any) -> None:
    for k in path[:-1]:
        d = d[k]
    if value is _DELETE:
        del d[path[-1]]
    else:
        d[path[-1]] = value


_DELETE = object()

BAD = [
    (["regions", 1, "replicas", 0, "sim"], _DELETE, "regions[1].replicas[0]", "exactly one of 'url'"),
    (["regions", 1, "replicas", 0, "sim"], {"profile": "nope", "port": 9}, "regions[1].replicas[0].sim.profile", "unknown profile"),
    (["regions", 0, "replicas", 1], {"id": "x", "url": "ftp://h:1"}, "regions[0].replicas[1].url", "http(s) URL"),
    (["regions", 0, "replicas", 1, "id"], "use1-r0", "regions[0].replicas[1].id", "duplicate replica id"),
    (["regions", 2, "name"], "us-east-1", "regions[2].name", "duplicate region"),
    (["regions", 0, "name"], "US East", "regions[0].name", "lowercase region name"),
    (["regions", 0, "source_networks", 0], "10.1.0.1/16", "regions[0].source_networks[0]", "CIDR"),
    (["regions", 0, "balancer", "listen"], "127.0.0.1", "regions[0].balancer.listen", "host:port"),
    (["regions", 0, "balancer", "listen"], "127.0.0.1:70000", "regions[0].balancer.listen", "port 1-65535"),
    (["regions", 1, "balancer", "listen"], "127.0.0.1:8101", "regions[1].balancer.listen", "already used"),
    (["regions", 0, "egress_source"], "127.9.0.1", "regions[0].egress_source", "not inside"),
    (["regions", 0, "colour"], "blue", "regions[0].colour", "unknown key"),
    (["latencies"], [{"regions": ["us-east-1", "eu-west-1"], "one_way_ms": 40}], "latencies", "missing one-way latency"),
    (["latencies", 0, "one_way_ms"], -1, "latencies[0].one_way_ms", "must be >= 0"),
    (["latencies", 0, "regions", 1], "mars-1", "latencies[0].regions[1]", "unknown region"),
    (["policy", "name"], "random", "policy.name", "unknown policy"),
    (["policy", "ttft_slo_s"], "fast", "policy.ttft_slo_s", "expected a number"),
    (["policy", "queue_bound"], 0, "policy.queue_bound", "must be >= 1"),
    (["offload", "rules", 0, "from"], "xx-*", "offload.rules[0].from", "matches no configured region"),
    (["offload", "enabled"], "yes", "offload.enabled", "true or false"),
    (["dns", "name"], "not a name", "dns.name", "DNS name"),
    (["dns", "provider"], "route53", "dns.hosted_zone", "is required"),
    (["dns", "routing"], "geo", "dns.routing", "'latency' or 'failover'"),
    (["dns", "routing"], "failover", "dns.routing", "use provider route53"),
    (["controller"], _DELETE, "controller", "is required"),
    (["regions"], [], "regions", "must not be empty"),
    (["peer_tokn"], "x", "peer_tokn", "unknown key"),
]


@pytest.mark.parametrize(("path", "value", "where", "what"), BAD, ids=[b[2] + ":" + b[3] for b in BAD])
def test_bad_config_names_exact_path(path: list[Any], value: Any, where: str, what: str) -> None:
    data = copy.deepcopy(base())
    _set(data, path, value)
    with pytest.raises(ConfigError) as ei:
        parse_config(data, profiles=PROFILES)
    assert ei.value.path == where, str(ei.value)
    assert what in ei.value.message, str(ei.value)


def test_failover_routing_needs_two_regions() -> None:
    data = copy.deepcopy(base())
    data["dns"].update(provider="route53", hosted_zone="example.com", routing="failover")
    with pytest.raises(ConfigError) as ei:
        parse_config(data, profiles=PROFILES)
    assert ei.value.path == "dns.routing" and "exactly 2 regions" in ei.value.message
    data["regions"] = data["regions"][:2]
    names = {r["name"] for r in data["regions"]}
    data["latencies"] = [e for e in data["latencies"] if set(e["regions"]) <= names]
    assert parse_config(data, profiles=PROFILES).dns.routing == "failover"


def test_not_a_mapping_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_config([1, 2], profiles=PROFILES)
    f = tmp_path / "bad.yaml"
    f.write_text("regions: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
