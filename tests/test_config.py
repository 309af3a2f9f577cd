"""Config loading: the shipped configs load; every bad config names its exact path."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from skymesh.bench.sim_setup import check_policy_options, options_for
from skymesh.cli import main as skymesh_main
from skymesh.config import ConfigError, load_config, parse_config
from skymesh.routing.base import PolicyContext
from skymesh.routing.policies.dualmap import DualMapOptions, DualMapPolicy
from skymesh.routing.registry import POLICIES, PolicyOptionsError, make_policy

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
    assert cfg.autoscaling.cloudwatch is not None and cfg.autoscaling.cloudwatch.namespace == "SkyMesh"


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
    (["policy", "options"], {"hash_lenght": 3}, "policy.options.hash_lenght", "unknown option for policy 'dualmap'"),
    (["policy", "options"], {"virtual_nodes": "many"}, "policy.options.virtual_nodes", "expected an integer"),
    (["policy", "options"], {"escape_over_slo": [1]}, "policy.options.escape_over_slo", "true or false"),
    (["policy", "options"], {"dispatch_budget": 0}, "policy.options.dispatch_budget", "must be >= 1"),
    (["policy", "options"], ["virtual_nodes"], "policy.options", "expected a mapping"),
    (["offload", "rules", 0, "from"], "xx-*", "offload.rules[0].from", "matches no configured region"),
    (["offload", "enabled"], "yes", "offload.enabled", "true or false"),
    (["dns", "name"], "not a name", "dns.name", "DNS name"),
    (["dns", "provider"], "route53", "dns.hosted_zone", "is required"),
    (["dns", "routing"], "geo", "dns.routing", "'latency' or 'failover'"),
    (["dns", "routing"], "failover", "dns.routing", "use provider route53"),
    (["controller"], _DELETE, "controller", "is required"),
    (["regions"], [], "regions", "must not be empty"),
    (["peer_tokn"], "x", "peer_tokn", "unknown key"),
    (["client_auth"], {"keys": [{"name": "a", "sha256": "0" * 64}, {"name": "a", "sha256": "1" * 64}]},
     "client_auth.keys[1].name", "duplicate key name 'a' (also keys[0])"),
    (["client_auth"], {"keys": [{"name": "a", "sha256": "0" * 64}, {"name": "b", "sha256": "0" * 64}]},
     "client_auth.keys[1].sha256", "the same key as keys[0]"),
    (["health"], {"unhealthy_threshold": 0}, "health.unhealthy_threshold", "must be >= 1"),
    (["health"], {"unhealthy_treshold": 2}, "health.unhealthy_treshold", "unknown key"),
    (["upstream"], {"first_byte_timeout_s": "soon"}, "upstream.first_byte_timeout_s", "expected a number"),
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


def test_a_key_given_twice_is_refused_and_merge_keys_still_work(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "local.yaml").read_text()
    f = tmp_path / "twice.yaml"
    # a second section pasted at the end would silently replace the first
    f.write_text(text + "offload:\n  enabled: false\n")
    with pytest.raises(ConfigError, match="duplicate key 'offload'"):
        load_config(f)
    f.write_text(text.replace("  ttl_s: 5\n", "  ttl_s: 5\n  ttl_s: 60\n"))
    with pytest.raises(ConfigError, match="duplicate key 'ttl_s'"):
        load_config(f)
    # an anchor merged with "<<" may be overridden beside it: that is no repeat
    merged = text.replace("  ttl_s: 5\n", "  <<: {ttl_s: 60, provider: embedded}\n  ttl_s: 7\n")
    f.write_text(merged)
    assert load_config(f).dns.ttl_s == 7


def test_unknown_policy_option_lists_the_known_ones() -> None:
    data = copy.deepcopy(base())
    data["policy"] = {"name": "consistent_hash", "options": {"virtual_node": 64}}
    with pytest.raises(ConfigError) as ei:
        parse_config(data, profiles=PROFILES)
    assert ei.value.path == "policy.options.virtual_node"
    assert "unknown option for policy 'consistent_hash' (known: dispatch_budget, virtual_nodes)" in ei.value.message
    # a dualmap knob is not one of round_robin's
    data["policy"] = {"name": "round_robin", "options": {"escape_over_slo": False}}
    with pytest.raises(ConfigError, match=r"policy\.options\.escape_over_slo: unknown option"):
        parse_config(data, profiles=PROFILES)


def test_unknown_policy_name_lists_the_registry() -> None:
    data = copy.deepcopy(base())
    data["policy"]["name"] = "fastest"
    with pytest.raises(ConfigError) as ei:
        parse_config(data, profiles=PROFILES)
    assert ei.value.path == "policy.name"
    assert ei.value.message == f"unknown policy 'fastest' (known: {', '.join(POLICIES)})"


def test_policy_options_arrive_typed_with_the_policy_defaults() -> None:
    data = copy.deepcopy(base())
    data["policy"] = {"name": "dualmap", "options": {"virtual_nodes": 64, "dispatch_budget": 5}}
    options = parse_config(data, profiles=PROFILES).policy.options
    assert isinstance(options, DualMapOptions)
    assert (options.virtual_nodes, options.dispatch_budget, options.escape_over_slo) == (64, 5, True)
    assert isinstance(load_config(None).policy.options, DualMapOptions)


def test_make_policy_validates_a_raw_mapping_and_coerces_strings() -> None:
    p = make_policy("dualmap", PolicyContext(options={"escape_over_slo": "false", "max_hold_fraction": "0.25"}))
    assert isinstance(p, DualMapPolicy)
    assert p.escape_over_slo is False and p.max_hold_fraction == 0.25
    with pytest.raises(PolicyOptionsError) as ei:
        make_policy("dualmap", PolicyContext(options={"hash_lenght": 3}))
    assert ei.value.path == "hash_lenght" and "unknown option for policy 'dualmap'" in ei.value.message
    with pytest.raises(PolicyOptionsError, match="virtual_nodes: expected an integer, got 'x'"):
        make_policy("consistent_hash", PolicyContext(options={"virtual_nodes": "x"}))


def test_options_of_another_policy_carry_only_the_shared_knobs() -> None:
    # the balancer's --policy override builds a policy from the config policy's options
    ctx = PolicyContext(options=DualMapOptions(dispatch_budget=7, virtual_nodes=3))
    p = make_policy("round_robin", ctx)
    assert p.ctx.options.model_dump() == {"dispatch_budget": 7}


def test_sim_policy_options_are_checked_against_the_systems_of_the_run() -> None:
    check_policy_options(["dualmap", "round_robin@local"], {"virtual_nodes": "64"})
    assert options_for("dualmap", {"virtual_nodes": "64"}) == {"virtual_nodes": 64}
    assert options_for("round_robin", {"virtual_nodes": "64"}) == {}
    with pytest.raises(SystemExit, match="--policy-option hash_lenght: unknown option"):
        check_policy_options(["dualmap", "round_robin"], {"hash_lenght": 3})
    with pytest.raises(SystemExit, match="--policy-option virtual_nodes: expected an integer"):
        check_policy_options(["dualmap"], {"virtual_nodes": "many"})


def test_config_objects_are_frozen() -> None:
    cfg = load_config(None)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.peer_token = "x"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        cfg.regions[0].name = "x"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        cfg.policy.options.dispatch_budget = 9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.regions[0].balancer.listen.port = 1  # type: ignore[misc]


def test_derived_values() -> None:
    cfg = load_config(None)
    use1 = cfg.region("us-east-1")
    assert use1.replicas[0].url == f"http://{use1.replicas[0].sim.host}:{use1.replicas[0].sim.port}"
    assert str(use1.balancer.listen) == "127.0.0.1:8101"
    data = copy.deepcopy(base())
    del data["regions"][0]["balancer"]["advertise"]
    data["regions"][0]["balancer"]["grpc_advertise"] = None  # null: the default too
    bal = parse_config(data, profiles=PROFILES).regions[0].balancer
    assert bal.advertise == bal.listen and bal.grpc_advertise == bal.grpc_listen
    assert bal.advertise_url == f"http://{bal.listen}"


@pytest.mark.parametrize("with_file", [False, True])
def test_schema_command_prints_the_json_schema(with_file: bool, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["config", "--schema"] + (["--config", str(ROOT / "configs" / "aws-3-regions.yaml")] if with_file else [])
    with pytest.raises(SystemExit) as ei:
        skymesh_main(argv)
    assert ei.value.code == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert set(schema["properties"]) == {
        "model", "regions", "latencies", "local_latency_ms", "controller", "dns", "policy", "offload",
        "health", "upstream", "peer_token", "emulate_latency", "tls",
        "client_auth", "admin", "client_timeouts", "http_limits", "tokenizer", "slo_classes", "default_slo_class",
        "slo_early_rejection", "queue", "siblings", "pairing", "membership", "autoscaling", "tracing",
    }
    assert set(schema["required"]) == {"regions", "controller", "dns"}
    policy = schema["$defs"]["PolicyConfig"]["properties"]
    assert policy["name"]["enum"] == list(POLICIES)


def test_schema_command_with_a_bad_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = copy.deepcopy(base())
    data["policy"]["options"] = {"hash_lenght": 3}
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as ei:
        skymesh_main(["config", "--schema", "--config", str(f)])
    assert ei.value.code == 2
    assert "policy.options.hash_lenght: unknown option" in capsys.readouterr().err


def fleet() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "configs" / "local-fleet.yaml").read_text())


def test_a_region_without_siblings_is_one_balancer_named_b0() -> None:
    use1 = parse_config(base(), profiles=PROFILES).region("us-east-1")
    assert use1.balancer.siblings == ()
    [only] = use1.balancer_members
    assert (only.index, only.id, str(only.listen), str(only.grpc_listen), str(only.peer_listen)) == (
        0, "us-east-1-b0", "127.0.0.1:8101", "127.0.0.1:9101", "127.0.0.1:8104")


def test_the_fleet_config_is_the_local_mesh_with_two_balancers_per_region() -> None:
    cfg = parse_config(fleet(), profiles=PROFILES)
    local = parse_config(base(), profiles=PROFILES)
    assert [r.name for r in cfg.regions] == [r.name for r in local.regions]
    for r, one in zip(cfg.regions, local.regions, strict=True):
        assert (r.balancer.advertise, r.balancer.grpc_advertise, r.balancer.peer_advertise) == (
            one.balancer.advertise, one.balancer.grpc_advertise, one.balancer.peer_advertise)
        assert [m.id for m in r.balancer_members] == [f"{r.name}-b0", f"{r.name}-b1"]
        first, second = r.balancer_members
        assert first.listen == one.balancer.listen and second.listen != first.listen
        assert second.peer_listen is not None and second.grpc_listen != first.grpc_listen


def test_a_sibling_may_name_its_id() -> None:
    data = fleet()
    data["regions"][0]["balancer"]["siblings"][0]["id"] = "use1-blue"
    r = parse_config(data, profiles=PROFILES).regions[0]
    assert [m.id for m in r.balancer_members] == ["us-east-1-b0", "use1-blue"]


FLEET_BAD = [
    (["regions", 1, "balancer", "siblings", 0, "listen"], "127.0.0.1:8101",
     "regions[1].balancer.siblings[0].listen", "already used by regions[0].balancer.listen"),
    (["regions", 0, "balancer", "siblings", 0, "grpc_listen"], "127.0.1.1:9100",
     "regions[0].balancer.siblings[0].grpc_listen", "already used by regions[0].balancer.grpc_advertise"),
    (["regions", 0, "balancer", "siblings", 0, "peer_listen"], _DELETE,
     "regions[0].balancer.siblings[0].peer_listen", "every balancer of the region needs its own"),
    (["regions", 0, "balancer", "advertise"], _DELETE,
     "regions[0].balancer.advertise", "entry address in front of all its balancers"),
    (["regions", 2, "balancer", "peer_advertise"], "127.0.0.1:8106",
     "regions[2].balancer.peer_advertise", "not the first balancer's peer_listen"),
    (["regions", 0, "balancer", "siblings", 0, "id"], "us-east-1-b0",
     "regions[0].balancer.siblings[0].id", "duplicate balancer id"),
    (["regions", 0, "balancer", "siblings", 0, "id"], "b 1",
     "regions[0].balancer.siblings[0].id", "letters, digits"),
    (["regions", 0, "balancer", "siblings", 0, "port"], 1,
     "regions[0].balancer.siblings[0].port", "unknown key"),
]


@pytest.mark.parametrize(("path", "value", "where", "what"), FLEET_BAD, ids=[b[2] + ":" + b[3] for b in FLEET_BAD])
def test_bad_fleet_config_names_exact_path(path: list[Any], value: Any, where: str, what: str) -> None:
    data = fleet()
    _set(data, path, value)
    with pytest.raises(ConfigError) as ei:
        parse_config(data, profiles=PROFILES)
    assert ei.value.path == where, str(ei.value)
    assert what in ei.value.message, str(ei.value)


def _three_mistakes(tmp_path: Path, cross_section: bool) -> tuple[Path, list[str]]:
    """A config with three independent mistakes: in three fields, or (``cross_section``)
    in three checks that span sections (the root model's validator)."""
    data = copy.deepcopy(base())
    if cross_section:
        data["default_slo_class"] = "gold"
        data["offload"]["rules"] = [{"from": "xx-*", "to": ["eu-*"]}]
        data["regions"][2]["balancer"]["listen"] = data["regions"][0]["balancer"]["listen"]
        expected = ["default_slo_class: unknown SLO class 'gold'",
                    "offload.rules[0].from: pattern 'xx-*' matches no configured region",
                    "regions[2].balancer.listen: address 127.0.0.1:8101 is already used by regions[0].balancer.listen"]
    else:
        data["regions"][1]["replicas"][0]["ur"] = "http://127.0.0.1:1"
        data["dns"]["ttl_s"] = "five"
        data["policy"]["ttft_slo_s"] = -1
        expected = ["regions[1].replicas[0].ur: unknown key", "dns.ttl_s: expected an integer, got 'five'",
                    "policy.ttft_slo_s: must be >= "]
    f = tmp_path / "three-mistakes.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    return f, expected


@pytest.mark.parametrize("cross_section", [False, True], ids=["fields", "cross-section"])
def test_every_mistake_is_reported_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           cross_section: bool) -> None:
    f, expected = _three_mistakes(tmp_path, cross_section)
    with pytest.raises(ConfigError) as ei:
        load_config(f)
    assert len(ei.value.errors) == 3, str(ei.value)  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as exit_info:
        skymesh_main(["config", "--config", str(f)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: 3 errors:\n")
    lines = [line.strip() for line in err.splitlines()[1:]]
    assert len(lines) == 3
    for what in expected:  # each one line, `path: message`
        assert sum(line.startswith(what) for line in lines) == 1, err


def test_a_daemon_reports_every_mistake_too(tmp_path: Path) -> None:
    import subprocess

    from skymesh.runtime.procs import skymesh_cmd

    f, expected = _three_mistakes(tmp_path, cross_section=False)
    out = subprocess.run(skymesh_cmd("balancer", "--config", str(f), "--region", "us-east-1"),
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    for what in expected:
        assert what in out.stderr, out.stderr
