"""The controller's membership sources put together: the table (controller/membership.py),
the registration API (controller/replica_registration.py), the AWS pollers
(controller/replica_aws.py) and the sweep that ends leases and drains. The controller
calls in at a few narrow places: it builds the topology (:meth:`assign`), its HTTP app
(:meth:`add_routes`), its loops (:meth:`loops`) and a config reload (:meth:`config_changed`).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry

from controller.core.drain import MemberLoad
from controller.membership import Membership
from controller.membership_store import MembershipStore
from controller.replica_aws import AwsSource
from controller.replica_registration import RegistrationApi
from controller.topology import region_owners
from skymesh.config import MeshConfig

log = logging.getLogger("skymesh.controller.membership")

# how often leases and drains are looked at (the sweep is a pass over the members)
SWEEP_INTERVAL_S = 0.2


class ControllerView(Protocol):
    """What the sources read of the controller."""

    cfg: MeshConfig
    version: int

    def alive_regions(self) -> set[str]: ...

    def live_member_loads(self, region: str) -> list[MemberLoad | None]:
        """The load each live balancer of ``region`` last reported (None: none yet)."""
        ...

    async def _changed(self, reason: str) -> None: ...


class MembershipSources:
    def __init__(self, controller: ControllerView, registry: CollectorRegistry) -> None:
        self._c = controller
        self.table = Membership(controller.cfg, registry, lambda: self._c.version)
        # the members across restarts, in the controller's SQLite file
        self.store = MembershipStore(controller.cfg.controller.state_path)
        restored = self.table.restore(self.store.load())
        if restored:
            log.info("membership restored", extra={"replicas": restored})
        self._save_lock = asyncio.Lock()
        self.api = RegistrationApi(self.table, lambda: self._c.cfg, self._changed)
        self.aws = [AwsSource(s, frozenset(r.name for r in controller.cfg.regions))
                    for s in controller.cfg.membership.aws]

    async def _changed(self, reason: str) -> None:
        async with self._save_lock:  # saves land in the order the changes happened
            try:
                await asyncio.to_thread(self.store.save, self.table.saved())
            except sqlite3.Error as e:  # a full or locked disk: serve on, unsaved (logged)
                log.warning("membership not saved", extra={"error": repr(e)[:300]})
        await self._c._changed(f"membership: {reason}")

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ hooks

    def assign(self, topology: Any) -> None:
        """Add the sources' replicas (draining ones marked) to a topology whose
        assignments hold the YAML replicas: each to the owner of its home region."""
        owners = region_owners(self._c.cfg, self._c.alive_regions())
        by_owner = {a.region: a for a in topology.balancers}
        for r in self._c.cfg.regions:
            a = by_owner.get(owners[r.name])
            if a is None:
                continue
            for m in self.table.of_region(r.name):
                a.replicas.add(replica_id=m.replica_id, url=m.url, home_region=m.region, draining=m.draining,
                               role=m.role)

    def roles(self) -> dict[str, str]:
        """replica id -> its role, of every replica a source other than the YAML gives."""
        return {m.replica_id: m.role for m in self.table.members.values()}

    def add_routes(self, app: web.Application) -> None:
        self.api.add_routes(app)

    def config_changed(self, old: MeshConfig, new: MeshConfig) -> None:
        self.table.config_changed(old, new)
        self.api.reload(new)

    def loops(self) -> list[tuple[str, Callable[[], Awaitable[None]], float]]:
        """(name, body, backoff) of the loops to supervise."""
        out: list[tuple[str, Callable[[], Awaitable[None]], float]] = [
            ("membership-sweep", self._sweep_loop, SWEEP_INTERVAL_S)]
        for src in self.aws:
            out.append((src.name, lambda src=src: self._poll_loop(src), src.cfg.poll_interval_s))
        return out

    def status_json(self) -> list[dict[str, Any]]:
        return self.table.status_json()

    # ------------------------------------------------------------------ loops

    async def sweep_once(self) -> None:
        owners = region_owners(self._c.cfg, self._c.alive_regions())
        loads = {r.name: self._c.live_member_loads(r.name) for r in self._c.cfg.regions}
        if self.table.sweep(owners, loads):
            await self._changed("leases or drains ended")

    async def _sweep_loop(self) -> None:
        while True:
            await self.sweep_once()
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def poll_once(self, src: AwsSource) -> bool:
        """One poll of ``src``; False when it failed (nothing changed then)."""
        try:
            found = await asyncio.to_thread(src.poll)
        except Exception as e:  # an AWS outage or a throttle: keep the replicas it had
            self.table.metrics.polls.labels(src.name, "error").inc()
            log.warning("membership poll failed", extra={"source": src.name, "error": repr(e)[:300]})
            return False
        self.table.metrics.polls.labels(src.name, "ok").inc()
        changed, refused = self.table.replace_source(src.name, found)
        if refused:
            log.warning("discovered replicas refused (the YAML's or another source's id, or a URL in use)",
                        extra={"source": src.name, "replicas": refused[:20]})
        if changed:
            await self._changed(f"{src.name} found {len(found)} replicas")
        return True

    async def _poll_loop(self, src: AwsSource) -> None:
        while True:
            await self.poll_once(src)
            await asyncio.sleep(src.cfg.poll_interval_s)
