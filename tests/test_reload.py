"""Config reload, the pure parts: which changed settings a balancer or the controller
applies live, which need a restart (the file is then refused whole), which they do not
read; and what applying new settings does to the region core (residency for queued
requests) and to the client gate (buckets of unchanged keys kept)."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import make_mocked_request

from controller.reload_rules import controller_reload_plan
from skymesh.balancer.auth import ClientKeyring
from skymesh.balancer.gate import CLIENT, ClientGate
from skymesh.balancer.reload_rules import reload_plan
from skymesh.config import MeshConfig, load_config_digest, parse_config
from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import Reject, SendToReplica
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy
from skymesh.routing.request_state import RequestState
from skymesh.runtime.reload_plan import ReloadPlan, changed_paths, path_text
from tests.test_region_core import probe_all, req

ROOT = Path(__file__).resolve().parent.parent
HERE = "us-east-1"


def local() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())


def edited(data: dict[str, Any], **changes: Any) -> MeshConfig:
    """``data`` with dotted-path changes ("policy.queue_bound": 8), validated."""
    out = copy.deepcopy(data)
    for dotted, value in changes.items():
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[leaf] = value
    return parse_config(out)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


BASE = local()
OLD = parse_config(BASE)


# ----------------------------------------------------------------------------- the diff


def test_an_unchanged_file_plans_nothing() -> None:
    assert reload_plan(OLD, parse_config(copy.deepcopy(BASE)), HERE) == ReloadPlan((), (), ())
    assert controller_reload_plan(OLD, parse_config(copy.deepcopy(BASE))) == ReloadPlan((), (), ())


def test_paths_name_regions_by_name_and_ignore_their_order() -> None:
    new = edited(BASE, **{"regions.1.replicas": BASE["regions"][1]["replicas"][:1]})
    assert [path_text(p) for p in changed_paths(OLD, new)] == ["regions[eu-west-1].replicas"]
    reordered = copy.deepcopy(BASE)
    reordered["regions"].reverse()
    assert changed_paths(OLD, parse_config(reordered)) == []


# ----------------------------------------------------------------------------- the balancer


def test_trust_limits_timeouts_health_queue_and_rules_apply_live() -> None:
    new = edited(BASE, **{
        "client_auth.keys": [{"name": "alice", "sha256": sha("sk-alice")}],
        "admin.metrics_access": "token",
        "upstream.first_byte_timeout_s": 5.0,
        "upstream.max_queue_wait_s": 20.0,
        "health.unhealthy_threshold": 1,
        "policy.queue_bound": 8,
        "policy.max_retries": 0,
        "offload.rules": [{"from": "us-*", "to": ["us-*"]}],
        "offload.max_remote_queue": 1,
        "offload.trigger": "saturated",
        "offload.min_gain_s": 0.1,
        "client_timeouts.body_timeout_s": 3.0,
    })
    changes, needs_restart, unused = reload_plan(OLD, new, HERE)
    assert needs_restart == () and unused == ()
    assert changes == ("admin.metrics_access", "client_auth.keys", "client_timeouts.body_timeout_s",
                       "health.unhealthy_threshold", "offload.max_remote_queue", "offload.min_gain_s",
                       "offload.rules", "offload.trigger", "policy.max_retries", "policy.queue_bound", "upstream.first_byte_timeout_s",
                       "upstream.max_queue_wait_s")


def test_what_needs_a_restart_is_named_and_refuses_the_file_whatever_else_changed() -> None:
    new = edited(BASE, **{
        "regions.0.balancer.listen": "127.0.0.1:18101",
        "regions.0.balancer.advertise": "127.0.1.1:18100",
        "regions.1.balancer.grpc_advertise": "127.0.1.2:19100",  # a peer's address
        "model": "other-model",
        "policy.name": "round_robin",
        "policy.chunk_tokens": 32,
        "controller.listen": "127.0.0.1:17001",
        "policy.queue_bound": 8,  # live, but the file is refused as a whole
    })
    p = reload_plan(OLD, new, HERE)
    # another policy's options are one change, not one per knob
    assert p.needs_restart == ("controller.listen", "model", "policy.chunk_tokens", "policy.name", "policy.options",
                               "regions[eu-west-1].balancer.grpc_advertise",
                               "regions[us-east-1].balancer.advertise", "regions[us-east-1].balancer.listen")
    assert p.changes == ("policy.queue_bound",)


def test_the_region_set_and_tls_need_a_restart() -> None:
    fewer = copy.deepcopy(BASE)
    fewer["regions"] = fewer["regions"][:2]
    fewer["latencies"] = fewer["latencies"][:1]
    fewer["offload"]["rules"] = []
    assert "regions" in reload_plan(OLD, parse_config(fewer), HERE).needs_restart
    tls = {"ca_cert": "ca.pem", "controller": {"cert": "c.pem", "key": "c.key"},
           "balancers": {r["name"]: {"cert": "b.pem", "key": "b.key"} for r in BASE["regions"]}}
    assert reload_plan(OLD, edited(BASE, tls=tls), HERE).needs_restart == ("tls",)


def test_own_replicas_are_live_without_a_controller_and_the_controllers_with_one() -> None:
    grown = BASE["regions"][0]["replicas"] + [{"id": "use1-r3", "url": "http://127.0.0.1:8204"}]
    new = edited(BASE, **{"regions.0.replicas": grown})
    assert reload_plan(OLD, new, HERE, own_replicas=True).changes == ("regions[us-east-1].replicas",)
    with_controller = reload_plan(OLD, new, HERE, own_replicas=False)
    assert with_controller.changes == () and with_controller.unused == ("regions[us-east-1].replicas",)
    # another region's replicas are its balancer's
    assert reload_plan(OLD, new, "eu-west-1").unused == ("regions[us-east-1].replicas",)


def test_other_daemons_settings_are_unused_by_a_balancer() -> None:
    new = edited(BASE, **{"dns.ttl_s": 30, "controller.state_path": "elsewhere.sqlite",
                          "regions.0.balancer.public_ip": "203.0.113.7", "regions.2.aws_region": "ap-northeast-1"})
    p = reload_plan(OLD, new, HERE)
    assert p.changes == () and p.needs_restart == ()
    assert p.unused == ("controller.state_path", "dns.ttl_s", "regions[ap-northeast-1].aws_region",
                        "regions[us-east-1].balancer.public_ip")


# ----------------------------------------------------------------------------- the controller


def test_the_controller_applies_membership_and_dns_it_owns_and_refuses_its_addresses() -> None:
    grown = BASE["regions"][1]["replicas"] + [{"id": "euw1-r3", "url": "http://127.0.0.1:8214"}]
    new = edited(BASE, **{"regions.1.replicas": grown, "regions.0.balancer.public_ip": "203.0.113.7",
                          "controller.failure_threshold": 5, "client_auth.keys_env": "OTHER_KEYS",
                          "dns.ttl_s": 30})
    p = controller_reload_plan(OLD, new)
    assert p.needs_restart == ()
    assert p.changes == ("controller.failure_threshold", "regions[eu-west-1].replicas",
                         "regions[us-east-1].balancer.public_ip")
    # the embedded DNS server's TTL is its own; the balancers' keys are theirs
    assert p.unused == ("client_auth.keys_env", "dns.ttl_s")
    refused = controller_reload_plan(OLD, edited(BASE, **{
        "controller.http_listen": "127.0.0.1:17002", "dns.listen": "127.0.0.1:15353",
        "regions.2.balancer.advertise": "127.0.1.3:18100", "policy.name": "round_robin"}))
    assert refused.needs_restart == ("controller.http_listen", "dns.listen", "policy.name",
                                     "regions[ap-northeast-1].balancer.advertise")


def test_a_route53_ttl_is_the_controllers_to_apply() -> None:
    r53 = copy.deepcopy(BASE)
    r53["dns"] = {"name": "llm.example.com", "provider": "route53", "hosted_zone": "example.com", "ttl_s": 5}
    old = parse_config(r53)
    assert controller_reload_plan(old, edited(r53, **{"dns.ttl_s": 60})).changes == ("dns.ttl_s",)
    assert controller_reload_plan(old, edited(r53, **{"dns.hosted_zone": "example.org"})).needs_restart == (
        "dns.hosted_zone",)


def test_the_digest_is_of_the_bytes_loaded(tmp_path: Path) -> None:
    f = tmp_path / "mesh.yaml"
    f.write_bytes((ROOT / "configs" / "local.yaml").read_bytes() + b"\n# a comment\n")
    cfg, digest = load_config_digest(f)
    assert digest == hashlib.sha256(f.read_bytes()).hexdigest()
    assert cfg == OLD  # a comment changes the digest, not the config


# ----------------------------------------------------------------------------- applying


def eu_stays_in_eu(source: str, target: str) -> bool:
    return not source.startswith("eu-") or target.startswith("eu-")


def test_a_tightened_rule_holds_for_requests_queued_before_it() -> None:
    # us-east-1's balancer adopted eu-west-1's replica; an EU client and a US client wait
    offload = OffloadRouter(HERE, {}, enabled=True)
    core = RegionCore(HERE, make_policy("least_load", PolicyContext()), offload, RegionSettings(dispatch_budget=1))
    core.set_replicas(["eu0"], 0.0, {"eu0": "eu-west-1"})
    eu = RoutingRequest("eu-client", req(0).chunk_hashes, 256, 0.0, origin_region="eu-west-1")
    us = RoutingRequest("us-client", req(1, prefix=1).chunk_hashes, 256, 0.0, origin_region="us-west-2")
    assert core.submit(us, 0.0) == [] and core.submit(eu, 0.0) == []  # eu0 not probed yet: queued
    # the reload: EU traffic stays in the EU, US traffic may not go there any more
    core.reconfigure(RegionSettings(dispatch_budget=1, queue_bound=5), allowed=lambda s, t: eu_stays_in_eu(s, t)
                     and not (s.startswith("us-") and t.startswith("eu-")), max_remote_queue=4, miss_limit=3)
    probe_all(core, 0.1)
    placed = [a for a in core.tick(0.1) if isinstance(a, SendToReplica)]
    # the US client queued first, but the new rule closes eu0 to it
    assert [(a.request_id, a.replica_id) for a in placed] == [("eu-client", "eu0")]
    assert core.local.queue_bound == 5 and core.settings.queue_bound == 5


def test_new_settings_leave_placed_and_queued_requests_where_they_are() -> None:
    offload = OffloadRouter(HERE, {}, enabled=False)
    core = RegionCore(HERE, make_policy("least_load", PolicyContext()), offload,
                      RegionSettings(dispatch_budget=1, max_queue_wait_s=10.0))
    core.set_replicas(["r0"], 0.0)
    probe_all(core)
    core.submit(req(0), 0.0)
    core.submit(req(1, prefix=1), 0.0)
    assert [a.request_id for a in core.tick(0.0) if isinstance(a, SendToReplica)] == ["q0"]
    core.reconfigure(RegionSettings(dispatch_budget=1, queue_bound=1, max_queue_wait_s=100.0),
                     allowed=lambda s, t: True, max_remote_queue=4, miss_limit=3)
    assert core.view.state_of("q0") is RequestState.PLACED and core.view.state_of("q1") is RequestState.QUEUED
    (full,) = core.submit(req(2, prefix=2, now=5.0), 5.0)  # the new bound of 1: q1 fills it
    assert isinstance(full, Reject) and (full.status, full.code) == (429, "queue_full")
    # q1 keeps the deadline it was queued with (10 s), not the new bound's
    assert [(a.request_id, a.status) for a in core.tick(10.0) if isinstance(a, Reject)] == [("q1", 504)]
    assert core.view.state_of("q0") is RequestState.PLACED


def gate_for(cfg: MeshConfig) -> ClientGate:
    return ClientGate(cfg, "admin-token", "X-Peer-Token", "X-Hop", "peer-token-long-enough",
                      keyring=ClientKeyring.from_config(cfg.client_auth, environ={}))


def bearer(key: str) -> Any:
    return make_mocked_request("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"})


def answer(gate: ClientGate, key: str, now: float) -> int:
    """The gate's word on a request with ``key``: 200 (let through), or its error status."""
    denied = gate.admit(bearer(key), now)[1]
    return 200 if denied is None else denied.status


def test_a_reloaded_gate_keeps_the_buckets_of_unchanged_keys() -> None:
    limited = {"requests_per_second": 1.0, "request_burst": 1}
    keys = [{"name": "alice", "sha256": sha("sk-alice"), "limits": limited},
            {"name": "bob", "sha256": sha("sk-bob"), "limits": {**limited, "prompt_tokens_per_minute": 10}}]
    cfg = edited(BASE, **{"client_auth.keys": keys})
    gate = gate_for(cfg)
    assert [answer(gate, k, 0.0) for k in ("sk-alice", "sk-bob", "sk-carol")] == [200, 200, 401]
    admitted_bob = bearer("sk-bob")  # admitted before the reload, its body still to come
    admitted_bob[CLIENT] = gate.keyring.authenticate("sk-bob")
    new_keys = [keys[0], {"name": "bob", "sha256": sha("sk-bob"), "limits": {"requests_per_second": 1.0,
                                                                             "request_burst": 5}},
                {"name": "carol", "sha256": sha("sk-carol")}]
    new = edited(BASE, **{"client_auth.keys": new_keys})
    gate.reconfigure(new, ClientKeyring.from_config(new.client_auth, environ={}), "new-admin-token")
    assert answer(gate, "sk-alice", 0.1) == 429  # unchanged: its one token is still spent
    assert answer(gate, "sk-bob", 0.1) == 200  # new limits: a new bucket
    assert answer(gate, "sk-carol", 0.1) == 200  # added
    assert gate.admin_token == "new-admin-token"
    gate.reconfigure(cfg, ClientKeyring.from_config(edited(BASE, **{"client_auth.keys": keys[:1]}).client_auth,
                                                    environ={}), None)
    assert answer(gate, "sk-bob", 0.2) == 401  # removed
    # a request admitted under the removed key goes on (no bucket to charge any more)
    assert gate.charge_prompt(admitted_bob, 1000, 0.2) is None


@pytest.mark.parametrize("bad", ["policy: [unclosed", "regions: []", "model: 1\n"])
def test_an_invalid_file_is_a_config_error_before_anything_is_compared(tmp_path: Path, bad: str) -> None:
    from skymesh.config import ConfigError

    f = tmp_path / "mesh.yaml"
    f.write_text(bad)
    with pytest.raises(ConfigError):
        load_config_digest(f)
