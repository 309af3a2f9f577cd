"""Dynamic membership, in process: the config section's exact error paths, the controller's
membership table (leases, drains, conflicts between sources), the topology it builds,
and the dispatcher's draining replicas."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from controller.membership import Discovered, Membership, MembershipRefused
from controller.service import ControllerService
from skymesh.config import ConfigError, MeshConfig, parse_config
from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.dispatcher import BalancerCore
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.registry import make_policy
from tests.mesh_helpers import local_config_free_ports


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def config(tmp_path: Any = None, **membership: Any) -> MeshConfig:
    data = local_config_free_ports()
    data["membership"] = membership
    if tmp_path is not None:
        data["controller"]["state_path"] = str(tmp_path / "controller.sqlite")
    return parse_config(data)


def table(cfg: MeshConfig, version: list[int] | None = None) -> tuple[Membership, Clock, list[int]]:
    clock = Clock()
    v = version if version is not None else [7]
    return Membership(cfg, CollectorRegistry(), lambda: v[0], clock), clock, v


def sample(m: Membership, name: str, **labels: str) -> float | None:
    for metric in (m.metrics.replicas, m.metrics.draining):
        for fam in metric.collect():
            for s in fam.samples:
                if s.name == name and s.labels == labels:
                    return s.value
    return None


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(("membership", "path"), [
    ({"aws": [{"aws_region": "us-east-1", "auto_scaling_groups": [{"name": "g", "region": "mars-1"}]}]},
     "membership.aws[0].auto_scaling_groups[0].region"),
    ({"aws": [{"aws_region": "us-east-1"}]}, "membership.aws[0]"),
    ({"aws": [{"aws_region": "us-east-1", "tag_key": "k", "port": 0}]}, "membership.aws[0].port"),
    ({"aws": [{"aws_region": "us-east-1", "auto_scaling_groups": [{"name": "g", "region": "us-east-1"},
                                                                  {"name": "g", "region": "eu-west-1"}]}]},
     "membership.aws[0].auto_scaling_groups[1].name"),
    ({"registration": {"default_ttl_s": 100.0, "max_ttl_s": 10.0}}, "membership.registration.default_ttl_s"),
    ({"registration": {"regions": ["nowhere-1"]}}, "membership.registration.regions[0]"),
    ({"registration": {"enabled": "yes"}}, "membership.registration.enabled"),
    ({"registration": {"token_env": "1BAD"}}, "membership.registration.token_env"),
    ({"registration": {"allowed_networks": ["10.0.0.1/8"]}}, "membership.registration.allowed_networks[0]"),
    ({"drain_grace_s": -1.0}, "membership.drain_grace_s"),
    ({"surprise": 1}, "membership.surprise"),
])
def test_membership_config_errors_name_their_path(membership: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as e:
        config(**membership)
    assert e.value.path == path, str(e.value)


def test_membership_defaults() -> None:
    m = config().membership
    assert m.drain_grace_s == 30.0 and not m.registration.enabled and m.aws == ()
    assert m.registration.token_env == "SKYMESH_REGISTRATION_TOKEN"


# ----------------------------------------------------------------------------- table


def test_a_registration_joins_renews_and_its_lapsed_lease_drains_then_leaves() -> None:
    cfg = config(drain_grace_s=5.0)
    m, clock, version = table(cfg)
    assert m.register("new-1", "http://10.0.0.9:8000", "eu-west-1", 10.0) == (True, False)
    assert m.register("new-1", "http://10.0.0.9:8000", "eu-west-1", 10.0) == (False, True)
    assert sample(m, "skymesh_membership_replicas", region="eu-west-1", source="registration") == 1
    clock.now += 9.0
    assert not m.sweep({}, {})
    m.register("new-1", "http://10.0.0.9:8000", "eu-west-1", 10.0)  # renewed: 10 s more
    clock.now += 9.0
    assert not m.sweep({}, {}) and not m.members["new-1"].draining
    clock.now += 1.5
    assert m.sweep({}, {})  # the lease lapsed: draining, published at the next version
    member = m.members["new-1"]
    assert member.draining and member.drain_version == version[0] + 1
    assert sample(m, "skymesh_membership_draining", region="eu-west-1") == 1
    assert sample(m, "skymesh_membership_replicas", region="eu-west-1", source="registration") == 0
    clock.now += 4.9
    assert not m.sweep({}, {})
    clock.now += 0.2
    assert m.sweep({}, {}) and "new-1" not in m.members
    assert sample(m, "skymesh_membership_draining", region="eu-west-1") == 0


def test_a_drain_ends_once_the_owner_reports_nothing_in_flight_at_a_version_that_marks_it() -> None:
    cfg = config(drain_grace_s=60.0)
    m, _, version = table(cfg)
    m.register("new-1", "http://10.0.0.9:8000", "eu-west-1", 10.0)
    assert m.deregister("new-1") and not m.deregister("new-1")
    owners = {"eu-west-1": "us-east-1"}  # adopted by us-east-1
    drain_v = version[0] + 1
    idle = {"topology_version": drain_v, "replicas": {"new-1": {"in_flight": 0}}}
    stale = {"us-east-1": [{"topology_version": drain_v - 1, "replicas": {"new-1": {"in_flight": 0}}}]}
    busy = {"us-east-1": [{"topology_version": drain_v, "replicas": {"new-1": {"in_flight": 2}}}]}
    elsewhere = {"eu-west-1": [{"topology_version": drain_v, "replicas": {}}]}
    hostile = {"us-east-1": [{"topology_version": True, "replicas": {"new-1": {"in_flight": False}}}]}
    for reports in (stale, busy, elsewhere, hostile, {"us-east-1": "junk"}, {"us-east-1": []}, {"us-east-1": [None]}):
        assert not m.sweep(owners, reports), reports
    assert m.sweep(owners, {"us-east-1": [idle]})
    assert "new-1" not in m.members


def test_a_fleets_drain_ends_only_when_every_live_member_reports_the_replica_idle() -> None:
    cfg = config(drain_grace_s=60.0)
    m, _, version = table(cfg)
    m.register("new-1", "http://10.0.0.9:8000", "eu-west-1", 10.0)
    assert m.deregister("new-1")
    owners = {"eu-west-1": "eu-west-1"}
    drain_v = version[0] + 1
    idle = {"topology_version": drain_v, "replicas": {"new-1": {"in_flight": 0}}}
    busy = {"topology_version": drain_v, "replicas": {"new-1": {"in_flight": 1}}}
    # one member idle, the other still streaming on it; then one that has not reported yet
    assert not m.sweep(owners, {"eu-west-1": [idle, busy]})
    assert not m.sweep(owners, {"eu-west-1": [busy, idle]})
    assert not m.sweep(owners, {"eu-west-1": [idle, None]})
    assert "new-1" in m.members and m.members["new-1"].draining
    assert m.sweep(owners, {"eu-west-1": [idle, idle]})
    assert "new-1" not in m.members


def test_sources_cannot_take_each_others_ids_or_urls() -> None:
    cfg = config()
    m, _, _ = table(cfg)
    static_id = cfg.regions[0].replicas[0].id
    static_url = cfg.regions[0].replicas[0].url
    with pytest.raises(MembershipRefused) as e:
        m.register(static_id, "http://10.0.0.1:8000", cfg.regions[0].name, 10.0)
    assert e.value.status == 403
    with pytest.raises(MembershipRefused) as e:
        m.register("other", static_url, cfg.regions[0].name, 10.0)
    assert e.value.status == 409 and e.value.param == "url"
    m.register("new-1", "http://10.0.0.9:8000", "eu-west-1", 10.0)
    with pytest.raises(MembershipRefused) as e:
        m.register("new-1", "http://10.0.0.9:8000", "us-east-1", 10.0)
    assert e.value.status == 409 and e.value.param == "region"
    changed, refused = m.replace_source("aws:us-east-1", [Discovered("new-1", "http://10.0.0.10:8000", "us-east-1"),
                                                           Discovered("i-1", "http://10.0.0.11:8000", "us-east-1")])
    assert changed and refused == ["new-1"]
    with pytest.raises(MembershipRefused) as e:
        m.deregister("i-1")
    assert e.value.status == 403
    with pytest.raises(MembershipRefused) as e:
        m.deregister("nobody")
    assert e.value.status == 404


def test_the_registration_table_is_bounded() -> None:
    m, _, _ = table(config(registration={"max_replicas": 2}))
    m.register("a", "http://10.0.0.1:8000", "us-east-1", 10.0)
    m.register("b", "http://10.0.0.2:8000", "us-east-1", 10.0)
    with pytest.raises(MembershipRefused) as e:
        m.register("c", "http://10.0.0.3:8000", "us-east-1", 10.0)
    assert e.value.status == 429
    m.register("a", "http://10.0.0.1:8000", "us-east-1", 10.0)  # a renewal still works


def test_a_polled_source_adds_drains_and_brings_back() -> None:
    m, _, _ = table(config(drain_grace_s=30.0))
    one, two = (Discovered(f"i-{n}", f"http://10.0.0.{n}:8000", "us-east-1") for n in (1, 2))
    assert m.replace_source("aws:us-east-1", [one, two]) == (True, [])
    assert m.replace_source("aws:us-east-1", [one, two]) == (False, [])
    assert m.replace_source("aws:us-east-1", [one]) == (True, [])
    assert m.members["i-2"].draining and not m.members["i-1"].draining
    assert m.replace_source("aws:us-east-1", [one, two]) == (True, [])  # back in service
    assert not m.members["i-2"].draining


def test_no_grace_drops_at_once() -> None:
    m, _, _ = table(config(drain_grace_s=0.0))
    m.register("a", "http://10.0.0.1:8000", "us-east-1", 10.0)
    assert m.deregister("a") and "a" not in m.members


def test_a_reload_drains_the_yaml_replicas_it_removes() -> None:
    data = local_config_free_ports()
    old = parse_config(data)
    gone = data["regions"][0]["replicas"].pop()
    new = parse_config(data)
    m, _, _ = table(old)
    m.config_changed(old, new)
    assert m.members[gone["id"]].draining and m.members[gone["id"]].source == "static"


# ----------------------------------------------------------------------------- topology


def test_the_topology_carries_dynamic_replicas_to_the_owner_of_their_home_region(tmp_path: Any) -> None:
    cfg = config(tmp_path, drain_grace_s=30.0)
    svc = ControllerService(cfg)
    try:
        svc.membership.table.register("new-1", "http://10.0.0.9:8000", "eu-west-1", 10.0)
        svc.membership.table.register("new-2", "http://10.0.0.8:8000", "eu-west-1", 10.0)
        svc.membership.table.deregister("new-2")

        def replicas_of(region: str) -> dict[str, tuple[str, str, bool]]:
            a = next(b for b in svc.topology().balancers if b.region == region)
            return {x.replica_id: (x.url, x.home_region, x.draining) for x in a.replicas}

        assert replicas_of("eu-west-1")["new-1"] == ("http://10.0.0.9:8000", "eu-west-1", False)
        assert replicas_of("eu-west-1")["new-2"] == ("http://10.0.0.8:8000", "eu-west-1", True)
        # eu-west-1's balancer is dead: its nearest live region adopts its dynamic replicas too
        svc.regions["eu-west-1"].record.alive = False
        adopter = next(b.region for b in svc.topology().balancers
                       if any(x.replica_id == "new-1" for x in b.replicas))
        assert adopter != "eu-west-1"
        assert "new-1" not in replicas_of("eu-west-1")
    finally:
        svc.store.close()
        svc.membership.close()


# ----------------------------------------------------------------------------- dispatcher


def _req(i: int) -> RoutingRequest:
    return RoutingRequest(request_id=f"q{i}", chunk_hashes=prompt_chunk_hashes(f"request {i} " * 40, 64),
                          prompt_tokens=100, arrival=0.0)


def test_a_draining_replica_gets_nothing_new_and_its_in_flight_requests_finish() -> None:
    c = BalancerCore(make_policy("least_load", PolicyContext()), dispatch_budget=4)
    c.set_replicas(["r0", "r1"])
    for rid in c.replicas:
        c.update_replica(rid, healthy=True)
    c.submit(_req(0))
    c.submit(_req(1))
    placed = {d.replica_id for _, d in c.dispatch(0.0)}
    assert placed == {"r0", "r1"}
    on_r1 = next(r for r, f in c._in_flight.items() if f.replica_id == "r1")
    c.set_draining(["r1", "not-a-member"])
    assert c.draining == frozenset({"r1"})
    for i in range(2, 8):
        c.submit(_req(i))
    for step in range(4):
        for rid, v in c.replicas.items():  # probes keep coming: draining outlasts them
            c.update_replica(rid, healthy=True, num_running=v.in_flight)
        assert all(d.replica_id == "r0" for _, d in c.dispatch(0.1 * (step + 1)))
    assert c.replicas["r1"].in_flight == 1
    c.on_first_token(on_r1, 0.5)
    c.on_complete(on_r1, True, 0.6)
    assert c.replicas["r1"].in_flight == 0
    # no longer draining (the controller took it back): available with its next probe
    c.set_draining([])
    c.update_replica("r1", healthy=True)
    assert c.replicas["r1"].available


# ----------------------------------------------------------------------------- a region of dynamic replicas only


def test_a_region_without_yaml_replicas_needs_a_source_that_can_add_some(tmp_path: Any) -> None:
    data = local_config_free_ports()
    data["regions"][1]["replicas"] = []
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.path == "regions[1].replicas"
    name = data["regions"][1]["name"]
    other = data["regions"][0]["name"]
    for membership, ok in (
        ({"registration": {"enabled": True}}, True),
        ({"registration": {"enabled": True, "regions": [other]}}, False),
        ({"registration": {"enabled": False}}, False),
        ({"aws": [{"aws_region": "us-east-1", "auto_scaling_groups": [{"name": "g", "region": name}]}]}, True),
        ({"aws": [{"aws_region": "us-east-1", "auto_scaling_groups": [{"name": "g", "region": other}]}]}, False),
        ({"aws": [{"aws_region": "us-east-1", "tag_key": "skymesh:region"}]}, True),
    ):
        data["membership"] = membership
        if ok:
            parse_config(data)
        else:
            with pytest.raises(ConfigError) as e:
                parse_config(data)
            assert e.value.path == "regions[1].replicas", membership
    data["membership"] = {"registration": {"enabled": True}}
    data["controller"]["state_path"] = str(tmp_path / "controller.sqlite")
    svc = ControllerService(parse_config(data))
    try:
        assert not next(b for b in svc.topology().balancers if b.region == name).replicas
        svc.membership.table.register("first", "http://10.0.0.9:8000", name, 10.0)
        (only,) = next(b for b in svc.topology().balancers if b.region == name).replicas
        assert (only.replica_id, only.home_region, only.draining) == ("first", name, False)
    finally:
        svc.store.close()
        svc.membership.close()


def test_restore_leaves_out_what_no_longer_fits() -> None:
    from controller.membership_store import SavedMember

    cfg = config(drain_grace_s=30.0)
    static = cfg.regions[0].replicas[0]
    m, clock, _ = table(cfg)
    saved = [
        SavedMember("reg", "http://10.0.0.1:8000", "us-east-1", "registration", 20.0, False, 0),
        SavedMember("drn", "http://10.0.0.2:8000", "us-east-1", "registration", 20.0, True, 5),
        SavedMember(static.id, "http://10.0.0.3:8000", "us-east-1", "registration", 20.0, False, 0),  # YAML's now
        SavedMember("gone-src", "http://10.0.0.4:8000", "us-east-1", "aws:eu-north-1", None, False, 0),
        SavedMember("gone-region", "http://10.0.0.5:8000", "mars-1", "registration", 20.0, False, 0),
        SavedMember("dup-url", static.url, "us-east-1", "registration", 20.0, False, 0),
        SavedMember("old-yaml", "http://10.0.0.6:8000", "us-east-1", "static", None, False, 0),
    ]
    assert m.restore(saved) == 2
    assert set(m.members) == {"reg", "drn"}
    assert m.members["reg"].expires_at == clock.now + 20.0  # a full lease from the restart
    assert m.members["drn"].draining and m.members["drn"].drain_version == 5


def test_skymesh_status_shows_a_draining_replica() -> None:
    from skymesh.operations.status import render

    rep = {"url": "http://10.0.0.9:8000", "home_region": "us-east-1", "healthy": True, "available": False,
           "num_running": 2, "num_waiting": 0, "kv_cache_usage": 0.1, "draining": True}
    status = {"source": "controller", "controller": {"topology_version": 9}, "policy": "dualmap",
              "regions": [{"region": "us-east-1", "balancer_alive": True, "balancer_url": "http://b",
                           "balancer_id": "b1", "owned_replicas": [],
                           "report": {"replicas": {"joiner": rep, "r0": {**rep, "draining": False}}}}]}
    rows = {line.split()[0]: line.split()[2] for line in render(status).splitlines()
            if line.strip().startswith(("joiner", "r0"))}
    assert rows == {"joiner": "drain", "r0": "busy"}


def test_a_membership_file_from_before_roles_loads_its_members_as_both(tmp_path: Any) -> None:
    import sqlite3

    from controller.membership_store import MembershipStore, SavedMember

    path = tmp_path / "state.db"
    db = sqlite3.connect(str(path))
    db.executescript("CREATE TABLE dynamic_members (replica_id TEXT PRIMARY KEY, url TEXT NOT NULL, "
                     "region TEXT NOT NULL, source TEXT NOT NULL, ttl_s REAL, draining INTEGER NOT NULL, "
                     "drain_version INTEGER NOT NULL);"
                     "INSERT INTO dynamic_members VALUES ('old', 'http://10.0.0.5:8000', 'us-east-1', "
                     "'registration', 60, 0, 0);")
    db.close()
    store = MembershipStore(path)
    try:
        (old,) = store.load()
        assert (old.replica_id, old.role) == ("old", "both")
        store.save([old, SavedMember("new", "http://10.0.0.6:8000", "us-east-1", "registration", 60.0, False, 0,
                                     "decode")])
        assert [(m.replica_id, m.role) for m in store.load()] == [("new", "decode"), ("old", "both")]
    finally:
        store.close()
