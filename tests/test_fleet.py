"""A region is a fleet: several active-active balancers behind the region's entry
(config members, `skymesh balancer --member K`, the controller's per-member view)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skymesh.balancer.main import as_member, member_balancer_id, with_listen_ports
from skymesh.config import BalancerMember, HostPort, MeshConfig, load_config
from skymesh.operations.latency_proxy import DelayProxy
from skymesh.operations.up import Mesh
from tests.mesh_helpers import admin_auth, local_config_free_ports

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "configs" / "local-fleet.yaml"
US = "us-east-1"
SOURCE = "127.1.0.7"  # a client in us-east-1


def fleet_config() -> MeshConfig:
    return load_config(FLEET)


def test_member_k_listens_on_its_sibling_entry_and_keeps_the_region_entry() -> None:
    cfg = fleet_config()
    b = as_member(cfg, "eu-west-1", 1).region("eu-west-1").balancer
    sib = cfg.region("eu-west-1").balancer.siblings[0]
    assert (b.listen, b.grpc_listen, b.peer_listen) == (sib.listen, sib.grpc_listen, sib.peer_listen)
    entry = cfg.region("eu-west-1").balancer
    assert (b.advertise, b.grpc_advertise, b.peer_advertise) == (entry.advertise, entry.grpc_advertise,
                                                                 entry.peer_advertise)
    # the other regions are untouched; member 0 is the config itself
    assert as_member(cfg, "eu-west-1", 1).region("us-east-1") == cfg.region("us-east-1")
    assert as_member(cfg, "eu-west-1", 0) is cfg
    # the port overrides apply on top of the member's listeners
    moved = with_listen_ports(as_member(cfg, "eu-west-1", 1), "eu-west-1", 0, None).region("eu-west-1").balancer
    assert moved.listen == HostPort(sib.listen.host, 0) and moved.grpc_listen == sib.grpc_listen


def test_a_member_is_named_by_its_id_and_a_lone_balancer_as_before() -> None:
    cfg = fleet_config()
    assert member_balancer_id(cfg, "us-east-1", 1, None) == "us-east-1-b1"
    assert member_balancer_id(cfg, "us-east-1", 0, None) == "us-east-1-b0"
    assert member_balancer_id(cfg, "us-east-1", 1, "mine") == "mine"
    lone = load_config(ROOT / "configs" / "local.yaml")
    assert member_balancer_id(lone, "us-east-1", 0, None) is None  # a fresh id per process


def test_a_member_the_region_does_not_have_is_a_config_error() -> None:
    done = subprocess.run([sys.executable, "-m", "skymesh.cli", "balancer", "--config", str(FLEET),
                           "--region", "us-east-1", "--member", "2"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "has 2 balancer(s)" in done.stderr and "no member 2" in done.stderr


# ----------------------------------------------------------------------------- skymesh up


def one_region_fleet(tmp_path: Path) -> dict[str, Any]:
    """us-east-1 of the local mesh (free ports) with two balancers behind its entry."""
    data = local_config_free_ports(time_scale=1.0, siblings=1)
    data["regions"] = data["regions"][:1]
    for rep in data["regions"][0]["replicas"]:
        rep["sim"]["profile"] = "tiny-test"
    data["latencies"] = []
    data["offload"]["rules"] = []
    data["controller"].update(state_path=str(tmp_path / "controller.sqlite"), probe_interval_s=0.5,
                              failure_threshold=3)
    data["dns"]["ttl_s"] = 1
    return data


@contextlib.asynccontextmanager
async def running_fleet(tmp_path: Path) -> AsyncIterator[Mesh]:
    mesh = Mesh.from_dict(one_region_fleet(tmp_path), tmp_path / "run")
    await mesh.start()
    try:
        yield mesh
    finally:
        await mesh.stop()


async def member_status(member: BalancerMember) -> dict[str, Any] | None:
    with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
        async with aiohttp.ClientSession(headers=admin_auth()) as s, \
                s.get(member.listen.http_url + "/admin/status", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return dict(await r.json())
    return None


async def complete_on_a_new_connection(url: str, source: str, prompt: str, max_tokens: int = 8) -> int:
    """One completion on its own connection (the entry spreads connections, not requests);
    0 when the connection failed or broke."""
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": max_tokens}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(source, 0), force_close=True)) \
                as s, s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            await r.read()
            return r.status
    except (TimeoutError, aiohttp.ClientError, OSError):
        return 0


def http_entry(mesh: Mesh) -> DelayProxy:
    return next(p for p in mesh.proxies if p.region == US and p.kind == "http")


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_up_starts_every_member_behind_one_entry(tmp_path: Path) -> None:
    async with running_fleet(tmp_path) as mesh:
        region = mesh.cfg.region(US)
        assert sorted(mesh.balancer_members) == [(US, 0), (US, 1)]
        assert all(c.running() for c in mesh.balancer_members.values())
        statuses = [await member_status(m) for m in region.balancer_members]
        assert [s and s.get("balancer_id") for s in statuses] == [f"{US}-b0", f"{US}-b1"]
        entry = region.balancer.advertise_url
        codes = [await complete_on_a_new_connection(entry, SOURCE, f"hello {i}") for i in range(6)]
        assert codes == [200] * 6
        by_member = http_entry(mesh).connections_by_target
        assert all(by_member[(m.listen.host, m.listen.port)] >= 3 for m in region.balancer_members), by_member
        assert f"{US}" in mesh.describe() and "2 balancers" in mesh.describe()
