"""The controller's durable state in SQLite (WAL). Every call is synchronous and short;
the service runs them in a worker thread so the event loop never blocks on disk."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.balancer_members import MemberState
from controller.core.region_state import RegionRecord, StoredBalancer, StoredRegion

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS balancers (
    region TEXT PRIMARY KEY, balancer_id TEXT, epoch INTEGER, alive INTEGER NOT NULL,
    http_url TEXT, grpc_address TEXT, last_seen_ms INTEGER
);
CREATE TABLE IF NOT EXISTS ownership (
    replica_id TEXT PRIMARY KEY, owner_region TEXT NOT NULL, home_region TEXT NOT NULL, url TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS reports (region TEXT PRIMARY KEY, report_json TEXT NOT NULL, at_ms INTEGER);
CREATE TABLE IF NOT EXISTS report_protos (region TEXT PRIMARY KEY, report BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS balancer_members (
    region TEXT NOT NULL, member_key TEXT NOT NULL, balancer_id TEXT, epoch INTEGER, alive INTEGER NOT NULL,
    draining INTEGER NOT NULL DEFAULT 0, http_url TEXT, grpc_address TEXT, last_seen_ms INTEGER,
    instance_epoch INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (region, member_key)
);
"""
# a balancer's own epoch is a uint64 of its choosing; SQLite keeps signed 64-bit integers
SQLITE_MAX_INT = 2**63 - 1
# columns added since the table first shipped: (name, declaration) added to an older file
MEMBER_COLUMNS_ADDED = (("instance_epoch", "INTEGER NOT NULL DEFAULT 0"),)


@dataclass(frozen=True, slots=True)
class StoredState:
    """Everything the state file kept."""

    version: int
    regions: dict[str, StoredRegion]
    owners: dict[str, str]  # replica id -> owner region
    reports: dict[str, dict[str, Any]]  # region -> its latest report's admin JSON
    report_protos: dict[str, bytes]  # region -> its latest serialized BalancerReport
    # region -> member key -> its record (controller/balancer_members.py)
    members: dict[str, dict[str, StoredBalancer]]


class StateStore:
    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(p), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(balancer_members)")}
        for name, decl in MEMBER_COLUMNS_ADDED:
            if name not in have:
                self._db.execute(f"ALTER TABLE balancer_members ADD COLUMN {name} {decl}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def load(self) -> StoredState:
        with self._lock:
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
            regions = {
                r[0]: StoredRegion(balancer_id=r[1], epoch=r[2], alive=bool(r[3]), http_url=r[4],
                                   grpc_address=r[5], last_seen_ms=r[6])
                for r in self._db.execute(
                    "SELECT region, balancer_id, epoch, alive, http_url, grpc_address, last_seen_ms FROM balancers"
                )
            }
            owners = {r[0]: r[1] for r in self._db.execute("SELECT replica_id, owner_region FROM ownership")}
            reports = {r[0]: json.loads(r[1]) for r in self._db.execute("SELECT region, report_json FROM reports")}
            protos = {r[0]: bytes(r[1]) for r in self._db.execute("SELECT region, report FROM report_protos")}
            members: dict[str, dict[str, StoredBalancer]] = {}
            for r in self._db.execute("SELECT region, member_key, balancer_id, epoch, alive, draining, http_url,"
                                      " grpc_address, last_seen_ms, instance_epoch FROM balancer_members"):
                members.setdefault(r[0], {})[r[1]] = StoredBalancer(
                    balancer_id=r[2], epoch=r[3], alive=bool(r[4]), draining=bool(r[5]), http_url=r[6],
                    grpc_address=r[7], last_seen_ms=r[8], instance_epoch=r[9])
        return StoredState(version=int(meta.get("version", "0")), regions=regions, owners=owners,
                           reports=reports, report_protos=protos, members=members)

    def save_topology(self, version: int, owners: dict[str, tuple[str, str, str]],
                      regions: Mapping[str, RegionRecord],
                      members: Mapping[str, Sequence[MemberState]] | None = None) -> None:
        """owners: replica id -> (owner region, home region, url); regions: region -> its
        record; members: region -> its balancers."""
        with self._lock:
            db = self._db
            db.execute("BEGIN")
            try:
                db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('version', ?)", (str(version),))
                db.execute("DELETE FROM ownership")
                db.executemany(
                    "INSERT INTO ownership(replica_id, owner_region, home_region, url) VALUES (?, ?, ?, ?)",
                    [(rid, o, h, u) for rid, (o, h, u) in owners.items()],
                )
                for region, b in regions.items():
                    db.execute(
                        "INSERT OR REPLACE INTO balancers(region, balancer_id, epoch, alive, http_url, grpc_address,"
                        " last_seen_ms) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (region, b.balancer_id, b.epoch, int(b.alive), b.http_url, b.grpc_address, b.last_seen_ms),
                    )
                for region, region_members in (members or {}).items():
                    for m in region_members:
                        db.execute(
                            "INSERT OR REPLACE INTO balancer_members(region, member_key, balancer_id, epoch, alive,"
                            " draining, http_url, grpc_address, last_seen_ms, instance_epoch)"
                            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (region, m.key, m.balancer_id, m.epoch, int(m.alive), int(m.draining), m.http_url,
                             m.grpc_address, m.last_seen_ms, min(m.instance_epoch, SQLITE_MAX_INT)),
                        )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def save_member_epoch(self, region: str, member_key: str, balancer_id: str, epoch: int) -> None:
        """The epoch issued to one balancer's registration (and the region's, which is the
        highest of its members'): it must never repeat, even across a controller restart."""
        with self._lock:
            db = self._db
            db.execute("BEGIN")
            try:
                db.execute(
                    "INSERT INTO balancer_members(region, member_key, balancer_id, epoch, alive) VALUES (?, ?, ?, ?, 1)"
                    " ON CONFLICT(region, member_key) DO UPDATE SET epoch = excluded.epoch,"
                    " balancer_id = excluded.balancer_id",
                    (region, member_key, balancer_id, epoch),
                )
                db.execute(
                    "INSERT INTO balancers(region, epoch, alive) VALUES (?, ?, 1)"
                    " ON CONFLICT(region) DO UPDATE SET epoch = max(coalesce(balancers.epoch, 0), excluded.epoch)",
                    (region, epoch),
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def forget_member(self, region: str, member_key: str) -> None:
        """Drop one balancer's record (a departed member the config does not list)."""
        with self._lock:
            self._db.execute("DELETE FROM balancer_members WHERE region = ? AND member_key = ?", (region, member_key))

    def save_report(self, region: str, report: dict[str, Any], at_ms: int, proto: bytes = b"") -> None:
        """The latest report of a region: its admin JSON and (when given) the raw
        serialized BalancerReport, so GetStatus can answer after a restart."""
        with self._lock:
            db = self._db
            db.execute("BEGIN")
            try:
                db.execute(
                    "INSERT OR REPLACE INTO reports(region, report_json, at_ms) VALUES (?, ?, ?)",
                    (region, json.dumps(report), at_ms),
                )
                if proto:
                    db.execute("INSERT OR REPLACE INTO report_protos(region, report) VALUES (?, ?)",
                               (region, proto))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
