"""`skymesh up` brings the mesh up and `skymesh status` sees it; status with nothing up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from skymesh.operations.status import render
from tests.mesh_helpers import ROOT, local_config_free_ports

pytestmark = pytest.mark.timeout(180)


def skymesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "skymesh.cli", *args]


def test_status_with_nothing_running_says_so(tmp_path: Path) -> None:
    cfg = local_config_free_ports()
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(skymesh("status", "--config", str(path)), capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 1
    assert "nothing is running" in out.stderr


def test_render_controller_view_and_fallback() -> None:
    rep = {"queue_length": 3, "offloaded_out": 5, "offloaded_in": 1, "prefix_hit_ratio": 0.5,
           "replicas": {"a-r0": {"healthy": True, "available": False, "num_running": 4, "num_waiting": 0,
                                 "kv_cache_usage": 0.9},
                        "b-r0": {"healthy": True, "available": True, "num_running": 0, "num_waiting": 0,
                                 "kv_cache_usage": 0.0}}}
    status = {"source": "controller", "controller": {"topology_version": 7}, "policy": "dualmap", "regions": [
        {"region": "a", "balancer_alive": True, "balancer_id": "a-1", "balancer_url": "http://x",
         "owned_replicas": [{"replica_id": "a-r0", "home_region": "a"}, {"replica_id": "b-r0", "home_region": "b"}],
         "report": rep},
        {"region": "b", "balancer_alive": False, "balancer_id": "b-1", "balancer_url": "http://y",
         "owned_replicas": [], "nearest_alive": "a", "report": None},
    ]}
    text = render(status)
    assert "topology v7" in text and "regions: 1/2 healthy" in text
    assert "replicas 1/2 available   queue 3   offloaded out 5 / in 1   prefix hits 50%" in text
    assert "b (adopted)" in text  # adopted replica shows its home region
    assert "balancer DOWN" in text and "replicas are adopted by a" in text
    status["source"] = "balancers"
    assert "controller: DOWN" in render(status)


@pytest.mark.slow
def test_up_then_status_shows_three_healthy_regions(tmp_path: Path) -> None:
    cfg = local_config_free_ports(time_scale=0.1)
    cfg["controller"]["state_path"] = str(tmp_path / "ctl.sqlite")
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115
    up = subprocess.Popen(skymesh("up", "--config", str(path), "--state-dir", str(tmp_path / "run")),
                          stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "skymesh is up" not in (tmp_path / "up.log").read_text():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "mesh did not come up"
            time.sleep(0.2)
        # Reports reach the controller once a second. Until every balancer has registered, the
        # controller hands a missing region's replicas to the nearest live one (failover), so a
        # first report can list 0 or 6 replicas: wait for the settled state, not the first report.
        for _ in range(50):
            out = subprocess.run(skymesh("status", "--config", str(path), "--json"), capture_output=True,
                                 text=True, cwd=ROOT, timeout=60)
            st = json.loads(out.stdout)
            if all(r.get("report") and len(r["report"]["replicas"]) == 3 for r in st["regions"]):
                break
            time.sleep(0.3)
        assert st["source"] == "controller"
        assert [r["balancer_alive"] for r in st["regions"]] == [True, True, True]
        assert all(len(r["report"]["replicas"]) == 3 for r in st["regions"]), st
        table = subprocess.run(skymesh("status", "--config", str(path)), capture_output=True, text=True,
                               cwd=ROOT, timeout=60).stdout
        assert "regions: 3/3 healthy" in table
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()
    assert up.returncode == 0
    # every child was stopped: the balancer ports are free again
    import socket

    for r in cfg["regions"]:
        host, port = r["balancer"]["listen"].rsplit(":", 1)
        with socket.socket() as s:
            # SO_REUSEADDR: connections in TIME_WAIT are fine, a live listener is not
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))
