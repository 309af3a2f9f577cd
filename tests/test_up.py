"""`skymesh up` and its pieces: process supervision, the pre-flight address check, the
banner, and the whole local mesh brought up from a copy of local.yaml on free ports,
seen healthy by `skymesh status --json`, then stopped cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from skymesh.operations.invocation import skymesh_command
from skymesh.operations.up import Mesh, MeshStartError
from skymesh.runtime.procs import (
    Child,
    bind_problem,
    ephemeral_port_range,
    free_port,
    skymesh_cmd,
    wait_all_ready,
)
from tests.mesh_helpers import ROOT, local_config_free_ports, report_figures


def mesh_parts_missing() -> str | None:
    for module in ("skymesh.balancer.main", "controller.main", "skymesh.dns.main", "skymesh.replica_sim.main"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not written yet"
    return None


def write_config(tmp_path: Path, time_scale: float = 0.1) -> tuple[Path, dict]:
    data = local_config_free_ports(time_scale=time_scale)
    data["controller"]["state_path"] = str(tmp_path / "controller.sqlite")
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, data


# ----------------------------------------------------------------------------- supervision


async def test_a_child_that_dies_is_named_with_its_log_tail(tmp_path: Path) -> None:
    bad = Child("broken-part", [sys.executable, "-c", "print('cannot load the model', flush=True); raise SystemExit(3)"],
                tmp_path)
    bad.start()
    with pytest.raises(RuntimeError) as e:
        await wait_all_ready([bad], within_s=60)
    assert "broken-part exited with 3 before it was ready" in str(e.value)
    assert "cannot load the model" in str(e.value)
    assert bad.returncode == 3


async def test_ready_line_gives_the_ports_and_silence_times_out(tmp_path: Path) -> None:
    talker = Child("talker", [sys.executable, "-c", (
        "import time\n"
        "print('warming up', flush=True)\n"
        "print('SKYMESH_READY {\"http\": 41234, \"grpc\": 41235}', flush=True)\n"
        "time.sleep(60)\n")], tmp_path)
    silent = Child("silent", [sys.executable, "-c", "import time; print('thinking', flush=True); time.sleep(60)"],
                   tmp_path)
    talker.start()
    silent.start()
    try:
        assert await talker.wait_ready(within_s=30) == {"http": 41234, "grpc": 41235}
        assert talker.port("grpc") == 41235
        with pytest.raises(TimeoutError, match="silent not ready after 0.5s") as e:
            await silent.wait_ready(within_s=0.5)
        assert "thinking" in str(e.value)  # the log tail comes with the failure
    finally:
        await talker.stop()
        await silent.stop()
    # a restart appends to the same log: the old run's ready line must not count
    talker.args = [sys.executable, "-c", "raise SystemExit(4)"]
    talker.start()
    with pytest.raises(RuntimeError, match="exited with 4"):
        await talker.wait_ready(within_s=30)


def test_free_port_stays_out_of_the_ephemeral_range() -> None:
    lo, hi = ephemeral_port_range()
    picked = [free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)  # never the same number twice in a process
    assert all(not lo <= p <= hi and p >= 10000 for p in picked)
    pair = free_port(span=2)
    assert bind_problem("127.0.0.1", pair + 1) is None and pair + 1 not in picked


async def test_stop_escalates_to_sigkill_for_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = Child("stubborn", [sys.executable, "-c", (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n")], tmp_path)
    stubborn.start()
    for _ in itertools.count():  # the test's own timeout guards against never
        if "ready" in stubborn.tail().splitlines():  # its output, not the command in the header
            break
        await asyncio.sleep(0.05)
    await stubborn.stop(grace_s=0.5)
    assert stubborn.returncode == -signal.SIGKILL
    await stubborn.stop()  # stopping twice is harmless


def test_a_restarted_childs_tail_is_its_own_run(tmp_path: Path) -> None:
    c = Child("part", [sys.executable, "-c", "print('first run')"], tmp_path)
    c.start()
    assert c.proc is not None and c.proc.wait(timeout=60) == 0
    c.args = [sys.executable, "-c", "print('second run')"]
    c.start()
    assert c.proc.wait(timeout=60) == 0
    assert "second run" in c.tail() and "first run" not in c.tail()
    assert "first run" in c.log_path.read_text()


# ----------------------------------------------------------------------------- pre-flight, banner


def test_bind_problem_sees_a_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert bind_problem("127.0.0.1", s.getsockname()[1]) == "already in use"
    assert bind_problem("127.0.0.1", free_port()) is None


async def test_start_refuses_taken_addresses_before_starting_anything(tmp_path: Path) -> None:
    path, data = write_config(tmp_path)
    host, port = data["controller"]["http_listen"].rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        s.listen()
        mesh = Mesh(path, tmp_path / "run")
        with pytest.raises(MeshStartError) as e:
            await mesh.start()
        assert f"controller HTTP: {host}:{port} already in use" in str(e.value)
        assert mesh.children() == [] and mesh.proxies == []
        # the CLI says the same, exit code 1
        p = await asyncio.create_subprocess_exec(
            *skymesh_cmd("up", "--config", str(path), "--state-dir", str(tmp_path / "run2")),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = await p.communicate()
    assert p.returncode == 1
    assert "the mesh did not come up" in err.decode() and "controller HTTP" in err.decode()


def test_up_rejects_a_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: x\nregions: []\n")
    out = subprocess.run(skymesh_cmd("up", "--config", str(path), "--state-dir", str(tmp_path / "run")),
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    # every mistake at once, one a line
    assert out.stderr.startswith("config error: 3 errors:\n")
    for line in ("  regions: must not be empty", "  controller: is required", "  dns: is required"):
        assert line in out.stderr.splitlines(), out.stderr


def test_banner_names_the_endpoint_and_how_to_query_it(tmp_path: Path) -> None:
    mesh = Mesh(ROOT / "skymesh" / "local.yaml", tmp_path)
    text = mesh.describe("configs/local.yaml")
    assert "endpoint       http://llm.skymesh.local:8100" in text
    assert "DNS server     127.0.0.1:5353" in text
    for r in mesh.cfg.regions:
        assert r.balancer.advertise_url in text
    # runnable as printed: the skymesh that runs this, no dig (tests/test_up_hints.py runs them)
    sm = skymesh_command()
    assert f"{sm} resolve --source 127.2.0.5 --config configs/local.yaml" in text
    assert f"curl --interface 127.2.0.5 --resolve llm.skymesh.local:8100:$({sm} resolve --short" in text
    assert f"{sm} status --config configs/local.yaml" in text
    assert "dig " not in text


async def test_real_replicas_are_only_health_checked_and_a_dead_one_is_a_warning(tmp_path: Path) -> None:
    from aiohttp import web

    app = web.Application()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    live_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", live_port).start()
    try:
        path, data = write_config(tmp_path)
        data["regions"][0]["replicas"] = [{"id": "gpu-live", "url": f"http://127.0.0.1:{live_port}"},
                                          {"id": "gpu-dead", "url": f"http://127.0.0.1:{free_port()}"}]
        for r in data["regions"][1:]:
            r["replicas"] = [{"id": f"{r['name']}-gpu", "url": f"http://127.0.0.1:{live_port}"}]
        mesh = Mesh.from_dict(data, tmp_path / "run", external_timeout_s=0.5)
        await mesh.start_replicas()
        assert mesh.replicas == {}  # nothing started for real servers
        assert mesh.unhealthy_external == ["gpu-dead"]
        assert "not healthy yet: gpu-dead" in mesh.describe()
    finally:
        await runner.cleanup()


# ----------------------------------------------------------------------------- the whole mesh


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_up_then_status_shows_three_healthy_regions_then_ctrl_c_stops_all(tmp_path: Path) -> None:
    if (why := mesh_parts_missing()) is not None:
        pytest.skip(why)
    path, data = write_config(tmp_path)
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        up = subprocess.Popen(skymesh_cmd("up", "--config", str(path), "--state-dir", str(tmp_path / "run")),
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        while "skymesh is up" not in log_path.read_text():
            assert up.poll() is None, log_path.read_text()
            time.sleep(0.2)
        st: dict = {}
        def all_healthy(st: dict) -> bool:
            return all(r.get("report") and len(r["report"]["replicas"]) == 3
                       and all(x["healthy"] for x in r["report"]["replicas"].values()) for r in st["regions"])

        # balancers report to the controller about once a second, and a first report may
        # come before the balancer's first replica probe: wait for the healthy view
        while True:
            out = subprocess.run(skymesh_cmd("status", "--config", str(path), "--json"), capture_output=True,
                                 text=True, cwd=ROOT, timeout=60)
            assert out.returncode == 0, out.stderr
            st = json.loads(out.stdout)
            if all_healthy(st):
                break
            time.sleep(0.3)
        assert st["source"] == "controller"
        assert [r["region"] for r in st["regions"]] == ["us-east-1", "eu-west-1", "ap-northeast-1"]
        assert all(r["balancer_alive"] for r in st["regions"])
        for r in st["regions"]:
            reps = r["report"]["replicas"]
            assert len(reps) == 3 and all(x["healthy"] for x in reps.values())
        table = subprocess.run(skymesh_cmd("status", "--config", str(path)), capture_output=True, text=True,
                               cwd=ROOT, timeout=60).stdout
        assert "regions: 3/3 healthy" in table
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)  # Ctrl-C
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    assert up.returncode == 0, log_path.read_text()
    assert "stopped." in log_path.read_text()
    # every child was stopped: nothing listens on the mesh's addresses any more
    mesh = Mesh(path, tmp_path / "check")
    assert [(what, host, port) for what, host, port, udp in mesh.listen_addresses()
            if bind_problem(host, port, udp) is not None] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_mesh_parts_restart_and_the_delay_proxy_carries_client_traffic(tmp_path: Path) -> None:
    if (why := mesh_parts_missing()) is not None:
        pytest.skip(why)
    path, data = write_config(tmp_path)
    mesh = Mesh(path, tmp_path / "run")
    await mesh.start()
    try:
        eu = mesh.cfg.region("eu-west-1").balancer
        body = {"model": mesh.cfg.model, "prompt": "hello mesh", "max_tokens": 4}
        # a client "in" ap-northeast-1 reaches the eu balancer through its delay proxy
        conn = aiohttp.TCPConnector(local_addr=("127.3.0.5", 0))
        async with aiohttp.ClientSession(connector=conn) as s:
            t0 = time.perf_counter()
            async with s.post(eu.advertise_url + "/v1/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["text"]
            assert time.perf_counter() - t0 >= 2 * 0.110  # one round trip of 110 ms each way
        # kill single parts and bring them back
        await mesh.stop_balancer("eu-west-1", kill=True)
        assert not mesh.balancers["eu-west-1"].running()
        await mesh.start_balancer("eu-west-1")
        await mesh.stop_replica("use1-r0", kill=True)
        await mesh.start_replica("use1-r0")
        await mesh.stop_dns()
        await mesh.start_dns()
        await mesh.stop_controller(kill=True)
        await mesh.start_controller()
        with pytest.raises(MeshStartError, match="already running"):
            await mesh.start_balancer("eu-west-1")
        async with aiohttp.ClientSession() as s, s.post(eu.listen.http_url + "/v1/completions", json=body) as r:
            assert r.status == 200
        pids = [c.pid for c in mesh.children()]
    finally:
        await mesh.stop()
    assert all(not c.running() for c in mesh.children())
    assert len(pids) == 9 + 1 + 1 + 3


async def test_a_stand_in_that_dies_is_restarted_with_backoff(tmp_path: Path) -> None:
    path, data = write_config(tmp_path)
    mesh = Mesh.from_dict(data, tmp_path / "run")
    await mesh.start_replicas()
    keeper: asyncio.Task[None] | None = None
    try:
        rid, child = next(iter(mesh.replicas.items()))
        old_pid = child.pid
        child.signal_group(signal.SIGKILL)  # a crash, not a stop the operator asked for
        keeper = asyncio.create_task(mesh.keep_replicas_running(backoff_s=0.2, check_every_s=0.05))
        for _ in range(600):
            if mesh.replica_restarts.get(rid) == 1:
                break
            await asyncio.sleep(0.05)
        assert mesh.replica_restarts == {rid: 1}  # only the dead one
        new = mesh.replicas[rid]
        assert new.running() and new.pid != old_pid
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{new.port()}/health") as r:
                assert r.status == 200
    finally:
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        await mesh.stop()


# ----------------------------------------------------------------------------- a parent killed hard

# a process that starts a chain of descendants through Child: `tree.py N` starts `tree.py
# N-1` (until 0), then reports its own pid and its descendants' on its ready line
TREE = """
import asyncio, os, sys
from pathlib import Path
from skymesh.runtime.procs import Child, report_ready

async def main(depth: int, log_dir: Path) -> None:
    pids = {f"level{depth}": os.getpid()}
    if depth > 0:
        child = Child(f"level{depth - 1}", [sys.executable, __file__, str(depth - 1), str(log_dir)], log_dir)
        child.start()
        pids.update(await child.wait_ready(within_s=120))
    report_ready(pids)
    await asyncio.Event().wait()

asyncio.run(main(int(sys.argv[1]), Path(sys.argv[2])))
"""


def proc_start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None when it is gone or a
    zombie: (pid, start time) names one process even if the pid is reused later."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def children_of(ppid: int) -> dict[int, int]:
    """pid -> start time of the live children of ``ppid``."""
    out: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == ppid and fields[0] not in ("Z", "X"):
            out[int(d.name)] = int(fields[19])
    return out


async def survivors(procs: dict[int, int], polls: int = 400) -> dict[int, int]:
    """The processes (pid -> start time) still alive after polling until none is, at most
    ``polls`` times 50 ms apart (the kernel kills them as soon as their parent is gone)."""
    left = dict(procs)
    for _ in range(polls):
        left = {pid: t for pid, t in left.items() if proc_start_time(pid) == t}
        if not left:
            break
        await asyncio.sleep(0.05)
    return left


def kill_leftovers(procs: dict[int, int]) -> None:
    """SIGKILL what the test started and outlived its parent (by pid, checked against its
    start time so a reused pid is never hit)."""
    for pid, t in procs.items():
        if proc_start_time(pid) == t:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.fault
async def test_children_and_grandchildren_die_with_a_parent_killed_hard(tmp_path: Path) -> None:
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    root = Child("level2", [sys.executable, str(script), "2", str(tmp_path)], tmp_path,
                 env={"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    root.start()
    procs: dict[int, int] = {}
    try:
        pids = await root.wait_ready(within_s=120)
        assert pids["level2"] == root.pid
        for name in ("level1", "level0"):
            t = proc_start_time(pids[name])
            assert t is not None, f"{name} is not running"
            procs[pids[name]] = t
        assert root.proc is not None
        os.kill(root.pid, signal.SIGKILL)  # the parent alone, as `kill -9 PID` does
        root.proc.wait()
        left = await survivors(procs)
        assert left == {}, f"still running after their parent was SIGKILLed: {sorted(left)}"
    finally:
        await root.stop()
        kill_leftovers(procs)


@pytest.mark.fault
async def test_a_port_held_by_another_process_is_named_with_its_pid_and_command(tmp_path: Path) -> None:
    path, data = write_config(tmp_path)
    host, port = data["controller"]["http_listen"].rsplit(":", 1)
    holder = Child("holder", [sys.executable, "-c", (
        "import socket, sys, time\n"
        "s = socket.socket()\n"
        "s.bind((sys.argv[1], int(sys.argv[2])))\n"
        "s.listen()\n"
        "print('SKYMESH_READY {}', flush=True)\n"
        "time.sleep(3600)\n"), host, port], tmp_path)
    holder.start()
    try:
        await holder.wait_ready(within_s=60)
        mesh = Mesh(path, tmp_path / "run")
        with pytest.raises(MeshStartError) as e:
            await mesh.start()
        msg = str(e.value)
        assert f"controller HTTP: {host}:{port} already in use by pid {holder.pid} (" in msg, msg
        assert "import socket, sys, time s = socket.socket()" in msg  # its command line
        assert mesh.children() == []
    finally:
        await holder.stop()


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_skymesh_up_killed_hard_leaves_no_child_running(tmp_path: Path) -> None:
    if (why := mesh_parts_missing()) is not None:
        pytest.skip(why)
    data = local_config_free_ports(time_scale=0.1)
    for r in data["regions"]:
        r["replicas"] = r["replicas"][:1]  # one stand-in per region: 8 children in all
    data["controller"]["state_path"] = str(tmp_path / "controller.sqlite")
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(data))
    up = Child("up", skymesh_cmd("up", "--config", str(path), "--state-dir", str(tmp_path / "run")), tmp_path,
               cwd=ROOT)
    up.start()
    procs: dict[int, int] = {}
    try:
        while "skymesh is up" not in up.log_path.read_text():  # the test's timeout guards against never
            assert up.running(), up.tail()
            await asyncio.sleep(0.2)
        assert up.pid is not None and up.proc is not None
        procs = children_of(up.pid)
        assert len(procs) == 3 + 1 + 1 + 3, (procs, up.tail())
        os.kill(up.pid, signal.SIGKILL)  # not its group: only `skymesh up` itself
        await asyncio.to_thread(up.proc.wait)
        left = await survivors(procs)
        report_figures("up_sigkill", children=len(procs), children_left=len(left))
        assert left == {}, f"children of a SIGKILLed `skymesh up` still running: {sorted(left)}"
        # and nothing holds the mesh's addresses any more: the next `make run` starts
        mesh = Mesh(path, tmp_path / "check")
        assert [(what, host, port) for what, host, port, udp in mesh.listen_addresses()
                if bind_problem(host, port, udp) is not None] == []
    finally:
        await up.kill()
        kill_leftovers(procs)
