"""`skymesh resolve`: the embedded DNS server asked as a client of each region, with no
package beyond the project's own (the README's DNS check, run as printed in tests/test_readme_commands.py)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from skymesh.cli import main
from skymesh.config import parse_config
from skymesh.dns.base import BalancerEndpoint
from skymesh.dns.embedded import MeshDnsServer
from skymesh.runtime.procs import free_port, skymesh_cmd
from tests.mesh_helpers import ROOT, local_config_free_ports


@pytest.fixture
async def mesh_dns(tmp_path: Path) -> AsyncIterator[tuple[MeshDnsServer, Path]]:
    """The local mesh's DNS server on free ports, and the config file naming them."""
    data = local_config_free_ports()
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    srv = MeshDnsServer(parse_config(data))
    await srv.start()
    try:
        yield srv, path
    finally:
        await srv.stop()


async def resolve(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``skymesh resolve ARGV`` in a thread (the server answers on this loop)."""

    def call() -> int:
        with pytest.raises(SystemExit) as e:
            main(["resolve", *argv])
        return int(e.value.code or 0)

    code = await asyncio.to_thread(call)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("source", "region"), [
    ("127.1.0.5", "us-east-1"), ("127.2.0.5", "eu-west-1"), ("127.3.0.5", "ap-northeast-1"),
])
async def test_a_client_of_each_region_gets_its_balancer(
        mesh_dns: tuple[MeshDnsServer, Path], capsys: pytest.CaptureFixture[str], source: str, region: str) -> None:
    srv, path = mesh_dns
    code, out, _ = await resolve(capsys, "--config", str(path), "--source", source)
    assert code == 0
    balancer = srv.cfg.region(region).balancer
    assert f"client {source}: a client of {region}" in out
    assert f"IN A {balancer.advertise.host}   -> the balancer of {region} ({balancer.advertise_url})" in out
    code, out, _ = await resolve(capsys, "--config", str(path), "--source", source, "--short")
    assert (code, out) == (0, balancer.advertise.host + "\n")


async def test_a_subnet_a_region_name_and_a_failed_over_answer(
        mesh_dns: tuple[MeshDnsServer, Path], capsys: pytest.CaptureFixture[str]) -> None:
    srv, path = mesh_dns
    ap = srv.cfg.region("ap-northeast-1").balancer.advertise.host
    code, out, _ = await resolve(capsys, "--config", str(path), "--subnet", "10.3.7.0/24", "--short")
    assert (code, out) == (0, ap + "\n")
    code, out, _ = await resolve(capsys, "--config", str(path), "eu-west-1", "--short")
    assert (code, out) == (0, srv.cfg.region("eu-west-1").balancer.advertise.host + "\n")
    # eu-west-1's balancer down: its clients get the nearest healthy one, and are told so
    eu = srv.endpoints["eu-west-1"]
    srv.update([BalancerEndpoint(region=eu.region, balancer_id=eu.balancer_id, ip=eu.ip, port=eu.port,
                                 healthy=False)])
    code, out, _ = await resolve(capsys, "--config", str(path), "--source", "127.2.0.5")
    assert code == 0
    assert "-> the balancer of us-east-1" in out and "the nearest healthy one to eu-west-1" in out


async def test_a_name_outside_the_mesh_and_no_server(
        mesh_dns: tuple[MeshDnsServer, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, path = mesh_dns
    code, out, _ = await resolve(capsys, "--config", str(path), "nope.llm.skymesh.local")
    assert code == 1 and "NXDOMAIN" in out
    data = yaml.safe_load(path.read_text())
    data["dns"]["listen"] = f"127.0.0.1:{free_port(span=2)}"  # nothing listens there
    down = tmp_path / "down.yaml"
    down.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = await resolve(capsys, "--config", str(down), "--timeout-s", "0.3")
    assert code == 1 and out == ""
    assert "skymesh resolve:" in err and "is the mesh up?" in err and "Traceback" not in err


async def test_the_command_as_installed(mesh_dns: tuple[MeshDnsServer, Path]) -> None:
    srv, path = mesh_dns
    p = await asyncio.create_subprocess_exec(
        *skymesh_cmd("resolve", "--config", str(path), "--source", "127.2.0.5"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await p.communicate()
    assert p.returncode == 0, err.decode()
    assert f"IN A {srv.cfg.region('eu-west-1').balancer.advertise.host}" in out.decode()
