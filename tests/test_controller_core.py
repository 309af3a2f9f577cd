"""The controller's pure decision core (controller/core/), with no network and no clock:
every verdict is asked at an explicit ``now``. Balancer membership (registration, epochs,
stale calls refused, probes, expiry), the region's failover and recovery (ownership and
DNS), and drain verdicts over a fleet's reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from controller.balancer_members import UNPROBED_REPORT_STALE_S, MemberState
from controller.core import balancer_liveness, failover
from controller.core.drain import GRACE, IDLE, MemberLoad, all_reported_idle, drain_end
from controller.core.recovery import recovered_region
from controller.core.region_state import (
    MemberReport,
    Now,
    RegionRecord,
    RegionState,
    StoredBalancer,
    StoredRegion,
)
from skymesh.config import MeshConfig, parse_config
from skymesh.proto_gen import mesh_pb2
from tests.mesh_helpers import local_config_free_ports
from tests.test_routing_purity import purity_violations

CORE_DIR = Path(__file__).resolve().parent.parent / "controller" / "core"
T0 = Now(wall_ms=1_000_000, monotonic_s=500.0)


def at(seconds: float) -> Now:
    """``seconds`` after T0 on both clocks."""
    return Now(wall_ms=T0.wall_ms + int(seconds * 1000), monotonic_s=T0.monotonic_s + seconds)


def member(key: str, grpc_port: int = 9, *, configured: bool = True,
           probe_url: str = "http://127.0.0.1:1") -> MemberState:
    return MemberState(key=key, configured=configured, http_url=f"http://127.0.0.1:{grpc_port + 1000}",
                       grpc_address=f"127.0.0.1:{grpc_port}", probe_url=probe_url)


def region(*members: MemberState, name: str = "us-east-1", presumed_until_s: float = 0.0) -> RegionState:
    state = RegionState(name=name, record=RegionRecord(balancer_id="", epoch=0, alive=True, http_url="http://x:1",
                                                       grpc_address="x:2", last_seen_ms=None),
                        members=list(members), presumed_alive_until_s=presumed_until_s)
    failover.refresh_region(state, T0)
    return state


def registered_pair() -> tuple[RegionState, MemberState, MemberState]:
    """A region of two listed balancers, each registered (epochs 1 and 2)."""
    a, b = member("use1-b0", 9), member("use1-b1", 10)
    state = region(a, b)
    for m, bid in ((a, "use1-b0"), (b, "use1-b1")):
        admitted = balancer_liveness.admit_registration(state, bid, 7, "", "", T0)
        assert admitted.member is m
        balancer_liveness.registered(state, m)
    return state, a, b


def report(state: RegionState, m: MemberState, admin: dict[str, object], now: Now = T0,
           unresponsive: tuple[str, ...] = ()) -> None:
    proto = mesh_pb2.BalancerReport(region=state.name, balancer_id=m.balancer_id, epoch=m.epoch,
                                    unresponsive_siblings=list(unresponsive))
    balancer_liveness.take_report(state, m, proto, admin, now)


def config() -> MeshConfig:
    return parse_config(local_config_free_ports())


# ----------------------------------------------------------------------------- membership


def test_the_controller_issues_every_epoch_above_all_the_regions_and_ignores_the_callers() -> None:
    state, a, b = registered_pair()
    assert (a.epoch, b.epoch) == (1, 2)
    assert a.instance_epoch == 7  # the caller's own epoch only names its sibling messages
    state.record.epoch = 10  # a state file's region epoch, above every member's
    # a restarted process of a listed member: a fresh id, on the member's own listener
    again = balancer_liveness.admit_registration(state, "use1-b0-restarted", 99, a.grpc_address, "", T0)
    assert again.member is a and again.epoch == 11 and again.changed
    # the same process registering again changes nothing but its epoch
    same = balancer_liveness.admit_registration(state, "use1-b0-restarted", 99, "", "", T0)
    assert same.member is a and not same.changed and same.epoch == 12
    assert len(state.members) == 2


def test_an_unlisted_balancer_joins_by_its_id_and_a_wildcard_address_is_never_kept() -> None:
    state = region(name="eu-west-1")  # a registered fleet: the config lists none
    admitted = balancer_liveness.admit_registration(state, "i-0abc", 1, "0.0.0.0:7000", "http://10.0.0.5:8080", T0)
    m = admitted.member
    assert state.members == [m] and m.key == "i-0abc" and not m.configured
    assert m.grpc_address == "" and m.http_url == "http://10.0.0.5:8080"
    other = balancer_liveness.admit_registration(state, "i-0def", 1, "10.0.0.6:7000", "", T0)
    assert other.member is not m and len(state.members) == 2  # distinct ids never fold


def test_a_second_live_balancer_on_a_region_of_one_is_named_as_displacing_it() -> None:
    only = member("use1")
    state = region(only)
    balancer_liveness.admit_registration(state, "first", 1, "", "", T0)
    balancer_liveness.mark(state, only, True, T0)
    recent = balancer_liveness.admit_registration(state, "second", 1, "", "", at(1))
    assert recent.displaced == "first"
    quiet = balancer_liveness.admit_registration(state, "third", 1, "", "", at(1 + UNPROBED_REPORT_STALE_S + 1))
    assert quiet.displaced is None  # the last one stopped reporting: a plain restart


def test_reports_and_deregistrations_of_an_older_registration_are_refused() -> None:
    state, a, _ = registered_pair()
    assert balancer_liveness.reporting_member(state, "use1-b0", a.epoch) is a
    assert balancer_liveness.reporting_member(state, "use1-b0", a.epoch + 5) is a  # not believed, not refused
    assert balancer_liveness.reporting_member(state, "use1-b0", a.epoch - 1) is None
    assert balancer_liveness.reporting_member(state, "nobody", 50) is None
    assert balancer_liveness.deregistering_member(state, "use1-b0", a.epoch - 1) is None
    assert balancer_liveness.deregistering_member(state, "use1-b0", a.epoch + 1) is None
    assert balancer_liveness.deregistering_member(state, "use1-b1", a.epoch) is None
    assert balancer_liveness.deregistering_member(state, "use1-b0", a.epoch) is a


def test_a_registration_drops_the_earlier_processs_report() -> None:
    state, a, _ = registered_pair()
    report(state, a, {"topology_version": 3, "replicas": {}})
    assert a.key in state.member_reports
    balancer_liveness.admit_registration(state, "use1-b0-new", 1, a.grpc_address, "", T0)
    assert a.key not in state.member_reports


def test_a_deregistered_balancer_stays_out_until_it_registers_again() -> None:
    state, a, b = registered_pair()
    balancer_liveness.start_drain(a)
    change = balancer_liveness.mark(state, a, False, at(1))
    assert change is not None and change.member_changed and not change.region_changed
    assert balancer_liveness.mark(state, a, True, at(2)) is None  # it still answers: ignored
    assert not a.alive
    assert balancer_liveness.admit_registration(state, "use1-b0", 1, "", "", at(3)).member is a
    assert balancer_liveness.registered(state, a) is False
    change = balancer_liveness.mark(state, a, True, at(3))
    assert change is not None and change.member_changed and a.alive and not a.draining


def test_probes_count_misses_to_the_threshold_and_a_good_probe_resets_them() -> None:
    m = member("use1")
    assert balancer_liveness.after_probe(m, False, 3).dead is False
    assert balancer_liveness.after_probe(m, False, 3).dead is False
    third = balancer_liveness.after_probe(m, False, 3)
    assert third.dead and third.taken_out
    assert balancer_liveness.after_probe(m, True, 3).alive
    m.alive = False
    for _ in range(3):
        verdict = balancer_liveness.after_probe(m, False, 3)
    assert verdict.dead and not verdict.taken_out  # already dead: not taken out again


def test_an_unprobed_balancer_is_alive_by_its_reports_alone() -> None:
    m = member("i-1", configured=False, probe_url="")
    m.last_seen_ms = T0.wall_ms
    assert balancer_liveness.unprobed_answer(m, at(UNPROBED_REPORT_STALE_S))[0]
    quiet, why = balancer_liveness.unprobed_answer(m, at(UNPROBED_REPORT_STALE_S + 1))
    assert not quiet and why == "no report for 4s"
    m.failures = 2
    verdict = balancer_liveness.after_probe(m, True, 3)
    assert not verdict.alive and m.failures == 0  # its reports, not the round, say it was seen


def test_a_departed_unlisted_balancer_is_forgotten_only_after_its_silence() -> None:
    listed = [member("use1-b0", 9), member("use1-b1", 10)]
    state = region(*listed)
    gone = balancer_liveness.admit_registration(state, "i-1", 1, "", "", T0).member
    assert not gone.configured and state.members == [*listed, gone]
    balancer_liveness.registered(state, gone)
    report(state, gone, {})
    for m in (*listed, gone):
        balancer_liveness.mark(state, m, True, T0)
        balancer_liveness.mark(state, m, False, T0)
    limit = balancer_liveness.FORGET_UNLISTED_AFTER_S
    assert balancer_liveness.forget_departed(state, at(limit)) == []
    assert balancer_liveness.forget_departed(state, at(limit + 1)) == [gone]
    assert state.members == listed  # a listed member is never forgotten
    assert state.latest_member is None and gone.key not in state.member_reports


# ----------------------------------------------------------------------------- failover


def test_a_region_is_alive_while_any_of_its_balancers_is() -> None:
    state, a, b = registered_pair()
    first = balancer_liveness.mark(state, a, False, at(1))
    assert first is not None and first.member_changed and not first.region_changed and state.record.alive
    last = balancer_liveness.mark(state, b, False, at(2))
    assert last is not None and last.region_changed and not state.record.alive
    back = balancer_liveness.mark(state, a, True, at(3))
    assert back is not None and back.region_changed and state.record.alive
    assert state.record.last_seen_ms == at(3).wall_ms
    # the region is named by its latest registration
    assert (state.record.balancer_id, state.record.epoch) == ("use1-b1", 2)


def test_a_registered_fleet_with_no_balancer_is_presumed_alive_until_its_deadline() -> None:
    state = region(name="eu-west-1", presumed_until_s=T0.monotonic_s + 10)
    assert state.record.alive
    assert not failover.refresh_region(state, at(9.9)) and state.record.alive
    assert failover.refresh_region(state, at(10)) and not state.record.alive
    assert failover.emptied_reason(state) == "eu-west-1 dead: no balancer registered"


def test_a_dead_region_leaves_dns_and_its_replicas_are_adopted_then_both_come_back() -> None:
    cfg = config()
    now = failover.presumed_alive_until(cfg, T0)
    regions = {r.name: recovered_region(r, None, {}, now) for r in cfg.regions}
    for s in regions.values():
        failover.refresh_region(s, T0)
    home = cfg.regions[0]
    replicas = {rep.id for rep in home.replicas}
    assert {o for rid, o in failover.owners(cfg, regions).items() if rid in replicas} == {home.name}
    assert all(e.healthy for e in failover.endpoints(cfg, regions))

    only = regions[home.name].members[0]
    change = balancer_liveness.mark(regions[home.name], only, False, at(1))
    assert change is not None and change.region_changed
    assert failover.member_change_reason(home.name, only, False, "HTTP 503", change.region_changed) \
        == f"{home.name} dead: HTTP 503"
    adopters = {o for rid, o in failover.owners(cfg, regions).items() if rid in replicas}
    nearest = min((r.name for r in cfg.regions if r.name != home.name),
                  key=lambda n: (cfg.one_way_ms(home.name, n), n))
    assert adopters == {nearest}
    assert {e.region: e.healthy for e in failover.endpoints(cfg, regions)}[home.name] is False

    balancer_liveness.mark(regions[home.name], only, True, at(2))
    assert {o for rid, o in failover.owners(cfg, regions).items() if rid in replicas} == {home.name}
    assert all(e.healthy for e in failover.endpoints(cfg, regions))


def test_saved_ownership_is_kept_only_when_it_covers_exactly_the_configs_replicas() -> None:
    cfg = config()
    regions = {r.name: recovered_region(r, None, {}, 0.0) for r in cfg.regions}
    every = {rep.id: "somewhere" for r in cfg.regions for rep in r.replicas}
    assert failover.recovered_owners(cfg, every, regions) == every
    partial = dict(list(every.items())[1:])
    assert failover.recovered_owners(cfg, partial, regions) == failover.owners(cfg, regions)


def test_a_restart_recovers_members_epochs_and_the_latest_registration() -> None:
    cfg = config()
    r = cfg.regions[0]
    key = r.balancer_members[0].id
    stored = {key: StoredBalancer(balancer_id="b-1", epoch=4, alive=False, draining=True, http_url=None,
                                  grpc_address=None, last_seen_ms=5, instance_epoch=9),
              "i-9": StoredBalancer(balancer_id="i-9", epoch=6, alive=True, draining=False,
                                    http_url="http://10.0.0.9:1", grpc_address="10.0.0.9:2", last_seen_ms=8,
                                    instance_epoch=1)}
    state = recovered_region(r, StoredRegion("i-9", 6, True, None, None, 8), stored, 0.0)
    listed, unlisted = state.members
    assert (listed.key, listed.epoch, listed.alive, listed.draining, listed.instance_epoch) == (key, 4, False, True, 9)
    assert (unlisted.key, unlisted.configured, unlisted.http_url) == ("i-9", False, "http://10.0.0.9:1")
    assert state.latest_member == "i-9"
    failover.refresh_region(state, T0)
    assert (state.record.balancer_id, state.record.epoch, state.record.alive) == ("i-9", 6, True)


# ----------------------------------------------------------------------------- drain


def idle_at(version: int, replica: str = "new-1") -> dict[str, object]:
    return {"topology_version": version, "replicas": {replica: {"in_flight": 0}}}


def busy_at(version: int, replica: str = "new-1") -> dict[str, object]:
    return {"topology_version": version, "replicas": {replica: {"in_flight": 2}}}


def test_a_drain_ends_only_when_every_live_member_reports_the_replica_idle() -> None:
    state, a, b = registered_pair()
    report(state, a, idle_at(8))
    report(state, b, busy_at(8))
    assert not all_reported_idle("new-1", 8, state.live_loads())
    report(state, b, idle_at(8))
    assert all_reported_idle("new-1", 8, state.live_loads())


def test_a_member_that_has_not_reported_blocks_the_drain_until_it_dies() -> None:
    state, a, b = registered_pair()
    report(state, a, idle_at(8))
    assert state.live_loads()[1] is None
    assert not all_reported_idle("new-1", 8, state.live_loads())
    balancer_liveness.mark(state, b, False, at(1))  # dead: no longer a witness
    assert all_reported_idle("new-1", 8, state.live_loads())


def test_a_dead_members_busy_report_no_longer_blocks_the_drain() -> None:
    state, a, b = registered_pair()
    report(state, a, idle_at(8))
    report(state, b, busy_at(8))
    balancer_liveness.start_drain(b)
    balancer_liveness.mark(state, b, False, at(1))
    assert all_reported_idle("new-1", 8, state.live_loads())


def test_a_report_made_before_the_drain_was_published_proves_nothing() -> None:
    assert not all_reported_idle("new-1", 8, [MemberLoad.from_admin(idle_at(7))])
    assert all_reported_idle("new-1", 8, [MemberLoad.from_admin(idle_at(9))])
    assert not all_reported_idle("new-1", 8, [])  # no live balancer: nobody said it


@pytest.mark.parametrize(("admin", "idle"), [
    ({"topology_version": 8, "replicas": {}}, True),  # it does not hold the replica
    ({"topology_version": 8, "replicas": {"new-1": None}}, True),  # a null entry is none
    ({"topology_version": True, "replicas": {"new-1": {"in_flight": 0}}}, False),
    ({"topology_version": 8, "replicas": {"new-1": {"in_flight": False}}}, False),
    ({"topology_version": 8, "replicas": {"new-1": {"in_flight": "0"}}}, False),
    ({"topology_version": 8, "replicas": {"new-1": 0}}, False),
    ({"topology_version": 8, "replicas": []}, False),
    ({"topology_version": 8}, False),
    ({}, False),
])
def test_an_admin_json_of_untrusted_shape_is_idle_only_when_it_says_so_in_integers(
        admin: dict[str, object], idle: bool) -> None:
    load = MemberLoad.from_admin(admin)
    assert load is not None and load.idle_on("new-1", 8) is idle


def test_the_grace_period_ends_a_drain_whatever_the_reports_say() -> None:
    busy = [MemberLoad.from_admin(busy_at(8))]
    assert drain_end("new-1", 8, 29.9, 30.0, busy) is None
    assert drain_end("new-1", 8, 30.0, 30.0, busy) == GRACE
    assert drain_end("new-1", 8, 1.0, 30.0, [MemberLoad.from_admin(idle_at(8))]) == IDLE
    assert MemberLoad.from_admin("junk") is None


# ----------------------------------------------------------------------------- siblings


def test_siblings_take_out_a_quiet_member_they_all_name() -> None:
    state, a, b = registered_pair()
    report(state, a, {}, T0)
    report(state, b, {}, T0)
    report(state, a, {}, at(5), unresponsive=("use1-b1",))
    assert balancer_liveness.taken_out_by_siblings(state, T0.wall_ms, at(5.5)) == [b]
    # b still reporting: nobody is taken out, whatever a says
    report(state, b, {}, at(5.2))
    assert balancer_liveness.taken_out_by_siblings(state, T0.wall_ms, at(5.5)) == []


def test_a_report_names_at_most_the_bounded_siblings() -> None:
    names = [f"b{i}" for i in range(300)] + ["x" * 200]
    rep = MemberReport.of({}, mesh_pb2.BalancerReport(unresponsive_siblings=names), 1)
    assert len(rep.unresponsive_siblings) == 256 and "x" * 200 not in rep.unresponsive_siblings


# ----------------------------------------------------------------------------- purity


def test_the_core_reads_no_clock_and_does_no_io() -> None:
    files = sorted(CORE_DIR.glob("*.py"))
    assert len(files) >= 5, files
    violations = [v for path in files for v in purity_violations(path.read_text(), path.name)]
    assert not violations, "controller/core/ must stay pure:\n" + "\n".join(violations)


def test_importing_the_core_loads_no_network_or_storage_library() -> None:
    code = ("import sys\n"
            "import controller.core.balancer_liveness, controller.core.recovery\n"
            "print(' '.join(sorted(m for m in ('grpc', 'aiohttp', 'boto3', 'botocore', 'sqlite3',"
            " 'prometheus_client') if m in sys.modules)))\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={"PYTHONPATH": str(root)}, check=True)
    assert out.stdout.strip() == ""
