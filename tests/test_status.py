"""`skymesh status`: rendering from canned JSON shaped per the controller / balancer
contracts, the fallback to balancers when the controller is down, and the clear message
(exit 1) when nothing runs."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from skymesh.config import parse_config
from skymesh.operations.status import balancer_admin_url, collect, nothing_running, render
from tests.mesh_helpers import ROOT, local_config_free_ports


def skymesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "skymesh.cli", *args]


def admin_status(region: str, replicas: dict[str, dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """A balancer's GET /admin/status."""
    out = {
        "region": region, "balancer_id": f"{region}-b1", "epoch": 3, "policy": "dualmap", "queue_length": 0,
        "in_flight": 0, "offloaded_out": 0, "offloaded_in": 0, "prefix_hit_ratio": 0.0, "replicas": replicas,
        "peers": {}, "controller_connected": True,
    }
    out.update(kw)
    return out


def replica(home: str, healthy: bool = True, available: bool = True, running: int = 0, waiting: int = 0,
            kv: float = 0.0) -> dict[str, Any]:
    return {"url": "http://127.0.0.1:1", "home_region": home, "healthy": healthy, "available": available,
            "num_running": running, "num_waiting": waiting, "kv_cache_usage": kv, "in_flight": running,
            "dispatched": 10}


US = admin_status(
    "us-east-1",
    {"use1-r0": replica("us-east-1", available=False, running=4, waiting=2, kv=0.9),
     "use1-r1": {**replica("us-east-1"), "cache_source": "events"},
     "euw1-r0": replica("eu-west-1", running=1, kv=0.25)},
    queue_length=3, offloaded_out=5, offloaded_in=1, prefix_hit_ratio=0.5,
    peers={"ap-northeast-1": {"available": True, "allowed": True, "staleness_s": 0.05, "queue_length": 0,
                              "replicas_available": 2, "replicas_total": 3, "rtt_ms": 160.4},
           "eu-west-1": {"available": False, "allowed": True, "staleness_s": 9.0, "queue_length": 0,
                         "replicas_available": 0, "replicas_total": 0, "rtt_ms": 0.0}},
)

CONTROLLER_VIEW: dict[str, Any] = {
    "source": "controller",
    "controller": {"started_unix_ms": 1, "topology_version": 7},
    "policy": "dualmap",
    "regions": [
        {"region": "us-east-1", "balancer_alive": True, "balancer_id": "us-east-1-b1", "balancer_epoch": 3,
         "balancer_url": "http://127.0.1.1:8100",
         "owned_replicas": [{"replica_id": "euw1-r0", "url": "http://x", "home_region": "eu-west-1"},
                            {"replica_id": "use1-r0", "url": "http://x", "home_region": "us-east-1"},
                            {"replica_id": "use1-r1", "url": "http://x", "home_region": "us-east-1"}],
         "nearest_alive": "us-east-1", "report": US},
        {"region": "eu-west-1", "balancer_alive": False, "balancer_id": "eu-west-1-b1", "balancer_epoch": 2,
         "balancer_url": "http://127.0.1.2:8100", "owned_replicas": [], "nearest_alive": "us-east-1",
         "report": None},
        {"region": "ap-northeast-1", "balancer_alive": True, "balancer_id": "ap-b1", "balancer_epoch": 1,
         "balancer_url": "http://127.0.1.3:8100",
         "owned_replicas": [{"replica_id": "apne1-r0", "url": "http://x", "home_region": "ap-northeast-1"}],
         "nearest_alive": "ap-northeast-1", "report": None},
    ],
}


def test_render_the_controller_view() -> None:
    text = render(CONTROLLER_VIEW)
    assert "controller: up (topology v7), policy dualmap" in text
    assert "regions: 2/3 healthy" in text
    assert "== us-east-1  balancer up  http://127.0.1.1:8100  us-east-1-b1" in text
    assert "replicas 2/3 available   queue 3   offloaded out 5 / in 1   prefix hits 50%" in text
    lines = text.splitlines()
    row = next(ln.split() for ln in lines if ln.strip().startswith("use1-r0"))
    assert row == ["use1-r0", "us-east-1", "busy", "4", "2", "90%", "history"]
    # a replica whose KV events the balancer reads
    assert next(ln.split() for ln in lines if ln.strip().startswith("use1-r1"))[-1] == "events"
    adopted = next(ln for ln in lines if ln.strip().startswith("euw1-r0"))
    assert "eu-west-1 (adopted)" in adopted and adopted.split()[-5:] == ["avail", "1", "0", "25%", "history"]
    assert "peers: ap-northeast-1 avail (2/3, q 0, rtt 160.4 ms); eu-west-1 unavail (0/0, q 0)" in text
    assert "== eu-west-1  balancer DOWN" in text
    # a deregistered (draining) balancer is told apart from a dead one
    import copy

    draining = copy.deepcopy(CONTROLLER_VIEW)
    draining["regions"][1]["balancer_draining"] = True
    assert "== eu-west-1  balancer DRAINING" in render(draining)
    assert "its replicas are adopted by us-east-1" in text
    # alive, but no report yet: what it owns, from the topology
    assert "owns: apne1-r0" in text


def test_render_shows_roles_where_a_region_has_prefill_or_decode_replicas() -> None:
    # all ``both`` (or a balancer from before roles): no role column, no roles line
    aggregated = render(CONTROLLER_VIEW)
    assert "roles:" not in aggregated
    assert next(ln.split() for ln in aggregated.splitlines() if ln.split()[:1] == ["replica"])[2] == "state"
    view = copy.deepcopy(CONTROLLER_VIEW)
    us = view["regions"][0]
    us["report"]["replicas"]["use1-r0"]["role"] = "prefill"
    # a role only the controller's ownership names (the report's replica has none)
    us["owned_replicas"][2]["role"] = "decode"
    lines = render(view).splitlines()
    header = next(ln.split() for ln in lines if ln.split()[:1] == ["replica"])
    assert header == ["replica", "home", "role", "state", "running", "waiting", "KV", "cache"]
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.strip().startswith(("use1-", "euw1-"))}
    assert rows["use1-r0"] == ["use1-r0", "us-east-1", "prefill", "busy", "4", "2", "90%", "history"]
    assert rows["use1-r1"][2] == "decode" and rows["euw1-r0"][3] == "both"  # "eu-west-1 (adopted)" is two words
    assert "   roles: both 1/1, prefill 0/1, decode 1/1 available" in lines


def test_render_the_fallback_view_says_the_controller_is_down() -> None:
    cfg = parse_config(local_config_free_ports())
    from skymesh.operations.status import _from_balancer

    status = {"source": "balancers", "controller": None, "controller_url": "http://127.0.0.1:7002",
              "policy": "dualmap",
              "regions": [_from_balancer(cfg.regions[0], US), _from_balancer(cfg.regions[1], None),
                          _from_balancer(cfg.regions[2], None)]}
    text = render(status)
    assert text.splitlines()[0].startswith("controller: DOWN (no answer at http://127.0.0.1:7002)")
    assert "regions: 1/3 healthy" in text
    assert "eu-west-1 (adopted)" in text
    assert not nothing_running(status)
    status["regions"][0] = _from_balancer(cfg.regions[0], None)
    assert nothing_running(status)


def test_render_tolerates_missing_fields() -> None:
    sparse = {"source": "controller", "controller": {}, "regions": [
        {"region": "a", "balancer_alive": True, "report": {"replicas": {"r": {}}}},
        {"region": "b"},
    ]}
    text = render(sparse)
    assert "regions: 1/2 healthy" in text
    assert "replicas 0/1 available   queue -" in text


def test_status_asks_a_balancer_on_its_listen_address_unless_wildcard() -> None:
    data = local_config_free_ports()
    cfg = parse_config(data)
    assert balancer_admin_url(cfg.regions[0]) == cfg.regions[0].balancer.listen.http_url + "/admin/status"
    data["regions"][0]["balancer"]["listen"] = "0.0.0.0:18000"
    cfg = parse_config(data)
    assert balancer_admin_url(cfg.regions[0]) == cfg.regions[0].balancer.advertise_url + "/admin/status"


@contextlib.asynccontextmanager
async def serve(routes: dict[str, Any], host: str, port: int) -> AsyncIterator[None]:
    app = web.Application()
    for path, body in routes.items():
        async def handler(_: web.Request, body: Any = body) -> web.Response:
            return web.json_response(body)

        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def test_collect_falls_back_to_the_balancers_when_the_controller_is_down() -> None:
    cfg = parse_config(local_config_free_ports())
    us = cfg.regions[0].balancer.listen
    async with serve({"/admin/status": US}, us.host, us.port):
        status = await collect(cfg)
    assert status["source"] == "balancers"
    assert [r["balancer_alive"] for r in status["regions"]] == [True, False, False]
    assert status["regions"][0]["report"]["queue_length"] == 3
    assert {o["replica_id"]: o["home_region"] for o in status["regions"][0]["owned_replicas"]}["euw1-r0"] == \
        "eu-west-1"


async def test_collect_fills_a_missing_report_from_the_balancer() -> None:
    cfg = parse_config(local_config_free_ports())
    ctl = cfg.controller.http_listen
    ap = cfg.regions[2].balancer.listen
    ap_report = admin_status("ap-northeast-1", {"apne1-r0": replica("ap-northeast-1")})
    async with serve({"/v1/status": CONTROLLER_VIEW}, ctl.host, ctl.port), \
            serve({"/admin/status": ap_report}, ap.host, ap.port):
        status = await collect(cfg)
    assert status["source"] == "controller"
    ap_entry = status["regions"][2]
    assert ap_entry["report"] == ap_report and ap_entry["report_source"] == "balancer"
    assert status["regions"][1]["report"] is None  # a dead balancer is not asked


async def test_cli_json_and_table_against_a_running_controller(tmp_path: Path) -> None:
    data = local_config_free_ports()
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = parse_config(data)
    ctl = cfg.controller.http_listen
    view = copy.deepcopy(CONTROLLER_VIEW)
    view["regions"][2]["report"] = admin_status("ap-northeast-1", {})
    async with serve({"/v1/status": view}, ctl.host, ctl.port):
        # the CLI is a subprocess: run it without blocking this loop (it serves the fake)
        p = await asyncio.create_subprocess_exec(*skymesh("status", "--config", str(path), "--json"), cwd=ROOT,
                                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, _ = await p.communicate()
        assert p.returncode == 0
        got = json.loads(out)
        assert got["source"] == "controller"
        assert [r["balancer_alive"] for r in got["regions"]] == [True, False, True]
        p = await asyncio.create_subprocess_exec(*skymesh("status", "--config", str(path)), cwd=ROOT,
                                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, _ = await p.communicate()
        assert p.returncode == 0
        assert "regions: 2/3 healthy" in out.decode()


def test_status_with_nothing_running_says_so_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(local_config_free_ports()))
    for extra in ([], ["--json"]):
        out = subprocess.run(skymesh("status", "--config", str(path), *extra), capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
        assert out.returncode == 1
        assert "nothing is running" in out.stderr and "skymesh up" in out.stderr
        assert out.stdout == ""


def test_status_with_a_bad_config_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "mesh.yaml"
    data = local_config_free_ports()
    data["regions"][0]["replicas"][0]["url"] = "http://x:1"  # both url and sim
    path.write_text(yaml.safe_dump(data))
    out = subprocess.run(skymesh("status", "--config", str(path)), capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 2
    assert "regions[0].replicas[0]" in out.stderr


async def test_the_fallback_asks_every_balancer_of_a_fleet() -> None:
    cfg = parse_config(local_config_free_ports(siblings=1))
    us = cfg.regions[0]
    second = us.balancer_members[1]
    report = {**US, "balancer_id": second.id}
    async with serve({"/admin/status": report}, second.listen.host, second.listen.port):
        status = await collect(cfg)
    assert status["source"] == "balancers"
    entry = status["regions"][0]
    # the first balancer is down, the second answers: the region is up
    assert entry["balancer_alive"] and entry["balancer_id"] == second.id
    assert [(m["balancer_id"], m["alive"]) for m in entry["balancers"]] == [
        (us.balancer_members[0].id, False), (second.id, True)]
    assert "== us-east-1  1/2 balancers up" in render(status)
