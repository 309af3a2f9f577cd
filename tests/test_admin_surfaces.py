"""The admin token on the controller's HTTP API and the DNS control API's GET; where the
token comes from (env, file, the local state dir `skymesh up` writes) and that
`skymesh status` sends it."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from controller.service import ControllerService
from skymesh.config import MeshConfig, parse_config
from skymesh.dns.embedded import MeshDnsServer
from skymesh.operations.status import collect
from skymesh.operations.up import Mesh
from skymesh.security.admin_auth import LOCAL_TOKEN_FILE, ensure_local_token, resolve_admin_token
from tests.mesh_helpers import admin_auth, local_config_free_ports

pytestmark = pytest.mark.timeout(60)


def config(**sections: object) -> MeshConfig:
    data = local_config_free_ports()
    data.update(sections)
    return parse_config(data)


@pytest.fixture
async def controller_url() -> AsyncIterator[str]:
    svc = ControllerService(config())
    runner = web.AppRunner(svc.make_app(), handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_controller_status_and_topology_need_the_admin_token(controller_url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/status", "/v1/topology"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with s.get(controller_url + path, headers=headers) as r:
                    assert r.status == 401, (path, headers)
                    assert (await r.json())["error"]["code"] == "invalid_admin_token"
            async with s.get(controller_url + path, headers=admin_auth()) as r:
                assert r.status == 200, path
        async with s.get(controller_url + "/v1/topology", headers=admin_auth()) as r:
            topology = await r.json()
        # each replica's prefill/decode role (the config's until a report says otherwise)
        assert {x["role"] for b in topology["balancers"] for x in b["replicas"]} == {"both"}
        async with s.get(controller_url + "/health") as r:
            assert r.status == 200
        async with s.get(controller_url + "/metrics") as r:
            assert r.status == 200  # loopback client, default metrics_access


async def test_dns_control_get_needs_the_admin_token_and_put_the_peer_token() -> None:
    srv = MeshDnsServer(config())
    await srv.start()
    try:
        url = f"http://127.0.0.1:{srv.bound_ports['control']}/v1/endpoints"
        async with aiohttp.ClientSession() as s:
            async with s.get(url) as r:
                assert r.status == 401
            async with s.get(url, headers={"Authorization": f"Bearer {srv.peer_token}"}) as r:
                assert r.status == 401  # the peer token is not the admin token
            async with s.get(url, headers=admin_auth()) as r:
                assert r.status == 200
            async with s.put(url, json=[], headers=admin_auth()) as r:
                assert r.status == 401  # pushing endpoints is the controller's: peer token
    finally:
        await srv.stop()


def test_token_sources_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYMESH_ADMIN_TOKEN")
    state = tmp_path / "run"
    file = tmp_path / "admin.token"
    file.write_text("from-file\n")
    cfg = config(admin={"token_file": str(file)})
    assert resolve_admin_token(config(), state_dir=state) is None
    local = ensure_local_token(state)
    assert resolve_admin_token(config(), state_dir=state) == local
    assert resolve_admin_token(cfg, state_dir=state) == "from-file"
    monkeypatch.setenv("SKYMESH_ADMIN_TOKEN", "from-env")
    assert resolve_admin_token(cfg, state_dir=state) == "from-env"
    monkeypatch.setenv("OTHER_TOKEN", "other")
    assert resolve_admin_token(config(admin={"token_env": "OTHER_TOKEN"}), state_dir=state) == "other"


def test_local_token_is_private_random_and_stable(tmp_path: Path) -> None:
    first = ensure_local_token(tmp_path)
    assert len(first) >= 32
    assert ensure_local_token(tmp_path) == first
    mode = stat.S_IMODE(os.stat(tmp_path / LOCAL_TOKEN_FILE).st_mode)
    assert mode == 0o600
    assert ensure_local_token(tmp_path / "other") != first


def test_skymesh_up_gives_its_children_the_local_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYMESH_ADMIN_TOKEN")
    monkeypatch.delenv("SKYMESH_PEER_TOKEN", raising=False)
    mesh = Mesh.from_dict(local_config_free_ports(), tmp_path)
    token = (tmp_path / LOCAL_TOKEN_FILE).read_text().strip()
    peer = (tmp_path / "peer-token").read_text().strip()
    assert mesh.admin_token == token and token != peer
    assert mesh.child_env == {"SKYMESH_ADMIN_TOKEN": token, "SKYMESH_PEER_TOKEN": peer}
    # `skymesh status --state-dir` finds the same token
    assert resolve_admin_token(mesh.cfg, state_dir=tmp_path) == token
    # an operator's token wins over a generated one
    monkeypatch.setenv("SKYMESH_ADMIN_TOKEN", "operator")
    assert Mesh.from_dict(local_config_free_ports(), tmp_path / "b").admin_token == "operator"


async def test_status_sends_the_token_and_says_when_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str | None] = []

    async def admin_status(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer right":
            return web.json_response({"error": {}}, status=401)
        return web.json_response({"region": "us-east-1", "replicas": {}})

    app = web.Application()
    app.router.add_get("/admin/status", admin_status)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    data = local_config_free_ports()
    port = data["regions"][0]["balancer"]["listen"].rsplit(":", 1)[1]
    await web.TCPSite(runner, "127.0.0.1", int(port)).start()
    try:
        cfg = parse_config(data)
        monkeypatch.delenv("SKYMESH_ADMIN_TOKEN")
        (tmp_path / LOCAL_TOKEN_FILE).write_text("right\n")
        status = await collect(cfg, state_dir=tmp_path)
        assert seen[-1] == "Bearer right"
        assert status["regions"][0]["balancer_alive"]
        status = await collect(cfg, admin_token="wrong", state_dir=tmp_path)
        assert not status["regions"][0]["balancer_alive"]
        assert status["unauthorized"] == [cfg.regions[0].balancer.listen.http_url + "/admin/status"]
    finally:
        await runner.cleanup()


def test_no_peer_token_is_shipped_and_none_beyond_loopback_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skymesh.security.admin_auth import MissingSecretError, resolve_peer_token

    monkeypatch.delenv("SKYMESH_PEER_TOKEN", raising=False)
    cfg = config()
    assert cfg.peer_token is None  # nothing in the code or the local config
    # a listen host beyond loopback (a documentation address; nothing is bound here)
    with pytest.raises(MissingSecretError, match="SKYMESH_PEER_TOKEN"):
        resolve_peer_token(cfg, ("192.0.2.10",), state_dir=tmp_path)
    # loopback only: one token is made in the state dir, and every process there shares it
    made = resolve_peer_token(cfg, ("127.0.0.1",), state_dir=tmp_path)
    assert len(made) >= 32 and (tmp_path / "peer-token").stat().st_mode & 0o777 == 0o600
    assert resolve_peer_token(cfg, ("192.0.2.10",), state_dir=tmp_path) == made
    monkeypatch.setenv("SKYMESH_PEER_TOKEN", "from-the-environment-1234")
    assert resolve_peer_token(cfg, ("192.0.2.10",), state_dir=tmp_path) == "from-the-environment-1234"
