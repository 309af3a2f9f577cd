"""A region's balancers come and go: each registers (and gets its epoch), reports, is
probed, dies, deregisters and, unlisted and gone long enough, is forgotten.

A balancer is alive while its HTTP ``/health`` answers the controller's probe or it keeps
calling Register/Report (either resets its failure count); it is dead after
``failure_threshold`` consecutive failed probes with no Register/Report in between, once
its siblings' reports take it out (controller/sibling_watch.py), or once it deregisters.
A deregistered balancer stays out, whatever it answers, until it registers again.

The controller issues every epoch: each registration its own, above every epoch the
region's balancers had (the caller's own epoch only names its sibling messages). A call
from an older registration is refused: a report below the member's epoch, a deregistration
not of its current epoch and id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from controller.balancer_members import (
    UNPROBED_REPORT_STALE_S,
    MemberState,
    dialable,
    member_of_registration,
    registered_member,
)
from controller.core.failover import refresh_region
from controller.core.region_state import MemberReport, Now, RegionState
from controller.sibling_watch import WatchedMember, taken_out
from skymesh.proto_gen import mesh_pb2

# a member the config does not list, dead and silent this long, is forgotten (an Auto
# Scaling group replaces instances: their records must not pile up)
FORGET_UNLISTED_AFTER_S = 900.0


def dialable_url(url: str) -> bool:
    """An http(s) URL whose host is neither empty nor a wildcard."""
    try:
        u = urlparse(url)
        port = u.port
    except ValueError:
        return False
    return u.scheme in ("http", "https") and bool(u.hostname) and port is not None \
        and dialable(f"{u.hostname}:{port}")


# ---------------------------------------------------------------------- liveness


@dataclass(frozen=True, slots=True)
class LivenessChange:
    """What one balancer's new liveness changed: itself, and with it the whole region."""

    member_changed: bool
    region_changed: bool


def mark(state: RegionState, member: MemberState, alive: bool, now: Now) -> LivenessChange | None:
    """One balancer of the region is alive (seen now) or dead; the region follows its
    members. None: a deregistered balancer said to be alive, which only a new
    registration brings back (it still answers while it drains)."""
    if alive and member.draining:
        return None
    if alive:
        member.failures = 0
        member.last_seen_ms = now.wall_ms
    member_changed = member.alive != alive
    member.alive = alive
    region_changed = refresh_region(state, now)
    return LivenessChange(member_changed, region_changed)


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """What one probe round says of a balancer: ``alive`` (mark it seen), ``dead`` (mark
    it dead: its failures reached the threshold), or neither; ``taken_out``: dead now
    while it was live (counted as the probes taking it out)."""

    alive: bool = False
    dead: bool = False
    taken_out: bool = False


def unprobed_answer(member: MemberState, now: Now) -> tuple[bool, str]:
    """For a balancer the controller cannot probe: whether it reported lately, and if not
    for how long it has been quiet."""
    quiet_s = (now.wall_ms - (member.last_seen_ms or 0)) / 1000
    return quiet_s <= UNPROBED_REPORT_STALE_S, f"no report for {quiet_s:.0f}s"


def after_probe(member: MemberState, answered: bool, failure_threshold: int) -> ProbeVerdict:
    """Count one probe of ``member`` (``answered``: its /health said 200 or, unprobed, it
    reported lately)."""
    if answered and member.probe_url:
        return ProbeVerdict(alive=True)
    if answered:
        member.failures = 0  # it reported lately; only its calls say it was seen
        return ProbeVerdict()
    member.failures += 1
    if member.failures < failure_threshold:
        return ProbeVerdict()
    return ProbeVerdict(dead=True, taken_out=member.alive and not member.draining)


def watched(state: RegionState, started_ms: int) -> list[WatchedMember]:
    """The region's members as the sibling watch reads them: heard from at their latest
    report, registration or good probe, and never before this controller started (no
    report could reach it earlier)."""
    out = []
    for m in state.members:
        rep = state.member_reports.get(m.key)
        heard = max(t for t in (rep.at_ms if rep else None, m.last_seen_ms, started_ms) if t is not None)
        out.append(WatchedMember(
            key=m.key, balancer_id=m.balancer_id, alive=m.alive, draining=m.draining, heard_at_ms=heard,
            named_unresponsive=rep.unresponsive_siblings if rep else frozenset(),
            report_at_ms=rep.at_ms if rep else None))
    return out


def taken_out_by_siblings(state: RegionState, started_ms: int, now: Now) -> list[MemberState]:
    """The live members of the region its siblings' reports say are gone."""
    gone = set(taken_out(watched(state, started_ms), now.wall_ms))
    return [m for m in state.members if m.key in gone and m.alive]


def forget_departed(state: RegionState, now: Now) -> list[MemberState]:
    """Drop the members the config does not list that have been dead and silent past
    FORGET_UNLISTED_AFTER_S (with their reports); the ones dropped."""
    gone = [m for m in state.members if not m.configured and not m.alive
            and now.wall_ms - (m.last_seen_ms or 0) > FORGET_UNLISTED_AFTER_S * 1000]
    for m in gone:
        state.members.remove(m)
        state.member_reports.pop(m.key, None)
        if state.latest_member == m.key:
            state.latest_member = None
    return gone


# ---------------------------------------------------------------------- calls


@dataclass(frozen=True, slots=True)
class Admission:
    """A registration taken: the member it speaks for and the epoch issued to it.
    ``changed``: a new process (another id or instance epoch) for that member;
    ``displaced``: the balancer id of a live, reporting balancer the registration took
    the region's only listed member from (two balancers on one config), else None."""

    member: MemberState
    epoch: int
    changed: bool
    displaced: str | None


def admit_registration(state: RegionState, balancer_id: str, instance_epoch: int, member_grpc_address: str,
                       member_http_url: str, now: Now) -> Admission:
    """Match a registration to its member (a new one for a balancer the config does not
    list), record the process and issue the next epoch. Its own addresses are kept only
    when dialable: a wildcard is never published, nobody could dial it."""
    members = state.members
    own_grpc = member_grpc_address if dialable(member_grpc_address) else ""
    own_http = member_http_url if dialable_url(member_http_url) else ""
    member = member_of_registration(members, balancer_id, own_grpc)
    displaced = None
    if member is not None and member.configured and len(members) == 1 and balancer_id \
            and member.balancer_id and member.balancer_id != balancer_id and member.alive \
            and member.last_seen_ms is not None and now.wall_ms - member.last_seen_ms < UNPROBED_REPORT_STALE_S * 1000:
        # a listed region of one balancer takes any id (a restart picks a fresh one), so
        # two live balancers of one config fold onto its one member
        displaced = member.balancer_id
    if member is None:
        # a balancer the config does not list: a member of the fleet, known by its id,
        # alive by its reports
        member = MemberState(key=balancer_id or f"{state.name}-{len(members)}", configured=False,
                             http_url=own_http, grpc_address=own_grpc, probe_url="")
        members.append(member)
    elif not member.configured:
        # the same id again (a restarted process on the same instance): its addresses now
        member.grpc_address, member.http_url = own_grpc or member.grpc_address, own_http or member.http_url
    changed = member.balancer_id != balancer_id or member.instance_epoch != instance_epoch
    member.balancer_id = balancer_id
    # what its sibling messages carry: siblings refuse any other epoch for this id
    member.instance_epoch = instance_epoch
    state.member_reports.pop(member.key, None)  # an earlier process's
    epoch = max(max(m.epoch for m in members) + 1, state.record.epoch + 1)
    member.epoch = epoch
    return Admission(member, epoch, changed, displaced)


def registered(state: RegionState, member: MemberState) -> bool:
    """The admitted registration (its epoch persisted) names the region and ends the
    member's drain; whether the member was alive before."""
    state.latest_member = member.key
    was_alive = member.alive
    member.draining = False
    return was_alive


def reporting_member(state: RegionState, balancer_id: str, epoch: int) -> MemberState | None:
    """The member a report speaks for, or None: a report from an older registration of
    the balancer (or of none). An epoch larger than the issued one is not believed (and
    changes nothing)."""
    members = state.members
    member = registered_member(members, balancer_id) or (members[0] if len(members) == 1 else None)
    if member is None or epoch < member.epoch:
        return None
    return member


def admin_of(admin_json: str) -> dict[str, Any]:
    """A report's admin JSON as an object (anything else, or no JSON: an empty one)."""
    try:
        admin = json.loads(admin_json) if admin_json else {}
    except json.JSONDecodeError:
        return {}
    return admin if isinstance(admin, dict) else {}


def take_report(state: RegionState, member: MemberState, report: mesh_pb2.BalancerReport,
                admin: dict[str, Any], now: Now) -> None:
    """Keep an accepted report: the region's latest, and the member's own."""
    state.last_admin = admin
    state.last_report = report
    state.member_reports[member.key] = MemberReport.of(admin, report, now.wall_ms)
    if report.balancer_id:
        member.balancer_id = report.balancer_id
        # a balancer reporting before it registered (a controller restarted under it)
        # names its region until a registration does
        if state.latest_member is None:
            state.latest_member = member.key


def deregistering_member(state: RegionState, balancer_id: str, epoch: int) -> MemberState | None:
    """The member a deregistration takes out, or None: only a current registration may
    (a stale process, or a replayed call, must not black out the balancer that replaced
    it)."""
    member = registered_member(state.members, balancer_id)
    if member is None or epoch != member.epoch or balancer_id != member.balancer_id:
        return None
    return member


def start_drain(member: MemberState) -> None:
    """A deregistered balancer: out (it is then marked dead) until it registers again."""
    member.draining = True
    member.failures = 0
