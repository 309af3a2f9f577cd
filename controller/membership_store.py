"""The dynamic members in the controller's SQLite file (their own table, their own
connection), so a controller restart does not drop them from the topology until they
renew (registrations) or the next poll finds them (AWS).

Saved on every membership change (a renewal alone is not a change: leases are not
written per renewal). Restored at start: a registration gets a full lease of its ``ttl_s``
from the restart (its renewals since the last save were not written), a draining member
drains again from the restart, a member of a source no longer configured, of a region no
longer configured, or whose id the YAML now has, is left out.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from skymesh.routing.pairing.base import ROLES, Role

SCHEMA = """
CREATE TABLE IF NOT EXISTS dynamic_members (
    replica_id TEXT PRIMARY KEY, url TEXT NOT NULL, region TEXT NOT NULL, source TEXT NOT NULL,
    ttl_s REAL, draining INTEGER NOT NULL, drain_version INTEGER NOT NULL,
    role TEXT NOT NULL DEFAULT 'both'
);
"""
# a file written before roles: its members are ``both``
ADD_ROLE = "ALTER TABLE dynamic_members ADD COLUMN role TEXT NOT NULL DEFAULT 'both'"


@dataclass(frozen=True, slots=True)
class SavedMember:
    replica_id: str
    url: str
    region: str
    source: str
    ttl_s: float | None  # a registration's lease length; None: a polled source's
    draining: bool
    drain_version: int
    role: Role = "both"


class MembershipStore:
    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(p), check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(dynamic_members)")}
        if "role" not in columns:
            self._db.execute(ADD_ROLE)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def load(self) -> list[SavedMember]:
        with self._lock:
            rows = self._db.execute("SELECT replica_id, url, region, source, ttl_s, draining, drain_version, role"
                                    " FROM dynamic_members ORDER BY replica_id").fetchall()
        return [SavedMember(r[0], r[1], r[2], r[3], None if r[4] is None else float(r[4]), bool(r[5]), int(r[6]),
                            r[7] if r[7] in ROLES else "both")
                for r in rows]

    def save(self, members: list[SavedMember]) -> None:
        """Replace the saved members with ``members`` (one transaction)."""
        with self._lock:
            db = self._db
            db.execute("BEGIN")
            try:
                db.execute("DELETE FROM dynamic_members")
                db.executemany(
                    "INSERT INTO dynamic_members(replica_id, url, region, source, ttl_s, draining, drain_version,"
                    " role) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(m.replica_id, m.url, m.region, m.source, m.ttl_s, int(m.draining), m.drain_version, m.role)
                     for m in members])
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
