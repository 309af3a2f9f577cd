"""The commands `skymesh up` prints are runnable as printed: each is run here through a
shell, against the mesh's DNS server and an admin-guarded API on the config's ports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from skymesh.dns.embedded import MeshDnsServer
from skymesh.operations.invocation import skymesh_command
from skymesh.operations.up import Mesh
from skymesh.security.admin_auth import admin_middleware
from tests.mesh_helpers import ROOT, local_config_free_ports


@pytest.fixture
async def mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Mesh, Path]]:
    """A local mesh's config on free ports, its DNS server and a stand-in for the
    controller's guarded API; no admin token in the environment, so `skymesh up`'s
    local token file is the one in use."""
    monkeypatch.delenv("SKYMESH_ADMIN_TOKEN", raising=False)
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(local_config_free_ports(), sort_keys=False))
    m = Mesh(path, tmp_path / "run")
    dns = MeshDnsServer(m.cfg)
    await dns.start()
    app = web.Application(middlewares=[admin_middleware(lambda: m.admin_token, ("/v1/",), lambda: m.cfg)])

    async def status(_: web.Request) -> web.Response:
        return web.json_response({"controller": "ok"})

    app.router.add_get("/v1/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    http = m.cfg.controller.http_listen
    await web.TCPSite(runner, http.host, http.port).start()
    try:
        yield m, path
    finally:
        await runner.cleanup()
        await dns.stop()


async def shell(command: str) -> subprocess.CompletedProcess[str]:
    import asyncio

    return await asyncio.to_thread(subprocess.run, ["bash", "-c", command], cwd=ROOT, capture_output=True,
                                   text=True, timeout=60, env=dict(os.environ))


def hint(text: str, pattern: str) -> str:
    """The printed command line matching ``pattern``, without its trailing comment."""
    lines = [line for line in text.splitlines() if re.search(pattern, line)]
    assert len(lines) == 1, text
    return lines[0].split("#", 1)[0].strip()


def test_the_skymesh_command_runs_this_skymesh() -> None:
    out = subprocess.run(["bash", "-c", f"{skymesh_command()} resolve --help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--source" in out.stdout, out.stderr


async def test_the_printed_resolve_lines_answer(mesh: tuple[Mesh, Path]) -> None:
    m, path = mesh
    text = m.describe(str(path))
    eu = m.cfg.region("eu-west-1").balancer.advertise.host
    got = await shell(hint(text, r" resolve --source "))
    assert got.returncode == 0, got.stderr
    assert f"IN A {eu}" in got.stdout and "a client of eu-west-1" in got.stdout
    # the address the curl line resolves the name to
    inner = re.search(r"\$\((.+? resolve --short[^)]*)\)", text)
    assert inner is not None, text
    got = await shell(inner.group(1))
    assert (got.returncode, got.stdout) == (0, eu + "\n"), got.stderr


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl, as the printed line does")
async def test_the_printed_controller_line_authenticates(mesh: tuple[Mesh, Path]) -> None:
    m, path = mesh
    text = m.describe(str(path))
    token_file = m.state_dir / "admin-token"
    assert f"admin token: {token_file}" in text  # the banner's controller line says where
    got = await shell(hint(text, r"curl -H .Authorization: Bearer"))
    assert got.returncode == 0 and json.loads(got.stdout) == {"controller": "ok"}, got.stderr
    # without the header: a 401 that says how, and never the token
    url = m.cfg.controller.http_listen.http_url + "/v1/status"
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 401
        message = (await r.json())["error"]["message"]
    assert "Authorization: Bearer <admin token>" in message
    assert "$SKYMESH_ADMIN_TOKEN" in message and ".skymesh/run/admin-token" in message
    assert m.admin_token not in message


def test_a_non_default_state_dir_is_named_in_the_status_hint(tmp_path: Path) -> None:
    m = Mesh(ROOT / "configs" / "local.yaml", tmp_path / "elsewhere")
    line = hint(m.describe(None), r" status")
    assert line == f"{skymesh_command()} status --state-dir {tmp_path / 'elsewhere'}"


def test_the_token_hint_follows_where_the_mesh_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from skymesh.config import load_config
    from skymesh.operations.hints import admin_token_shell

    cfg = load_config(None)
    monkeypatch.setenv("SKYMESH_ADMIN_TOKEN", "from-env")
    assert admin_token_shell(cfg, tmp_path) == ("$SKYMESH_ADMIN_TOKEN", "$SKYMESH_ADMIN_TOKEN")
    monkeypatch.delenv("SKYMESH_ADMIN_TOKEN")
    assert admin_token_shell(cfg, tmp_path) == (str(tmp_path / "admin-token"), f"$(cat {tmp_path / 'admin-token'})")
    token_file = tmp_path / "ops token"
    token_file.write_text("from-file\n")
    with_file = cfg.model_copy(update={"admin": cfg.admin.model_copy(update={"token_file": str(token_file)})})
    where, shell_expr = admin_token_shell(with_file, tmp_path)
    assert where == f"'{token_file}'" and shell_expr == f"$(cat '{token_file}')"  # quoted: a space
