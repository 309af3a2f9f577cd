"""The registration API on a real controller (in process, its HTTP listener on loopback):
the token is checked before the body is read, the body is bounded before it is parsed,
every refusal is OpenAI-shaped and never a 5xx, and a registered replica joins the
topology, drains when deregistered or when its lease lapses, then leaves."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.service import ControllerService
from skymesh.config import parse_config
from tests.mesh_helpers import admin_auth, local_config_free_ports

pytestmark = pytest.mark.timeout(120)

TOKEN = "registration-token-for-tests-0123456789"
PATH = "/membership/v1/replicas"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def wait_until(pred: Callable[[], Awaitable[bool]], what: str, within_s: float = 30.0) -> None:
    """Polls ``pred``; ``within_s`` is a hang guard only."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


class Api:
    def __init__(self, svc: ControllerService, session: aiohttp.ClientSession) -> None:
        self.svc = svc
        self.s = session
        self.base = f"http://127.0.0.1:{svc.bound_ports['http']}"

    async def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                   data: bytes | None = None) -> tuple[int, Any]:
        if body is not None:
            data = json.dumps(body).encode()
        async with self.s.request(method, self.base + path, data=data,
                                  headers={**AUTH, **(headers or {})} if headers is None or "Authorization"
                                  not in headers else headers) as r:
            raw = await r.read()
            return r.status, json.loads(raw) if raw else None

    async def register(self, body: Any, **kw: Any) -> tuple[int, Any]:
        return await self.call("POST", PATH, body, **kw)

    async def topology(self) -> dict[str, dict[str, Any]]:
        async with self.s.get(self.base + "/v1/topology", headers=admin_auth()) as r:
            assert r.status == 200
            doc = await r.json()
        return {x["replica_id"]: {**x, "owner": b["region"]} for b in doc["balancers"] for x in b["replicas"]}

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        async with self.s.get(self.base + "/metrics") as r:
            text = await r.text()
        return {(x.name, tuple(sorted(x.labels.items()))): x.value
                for fam in text_string_to_metric_families(text) for x in fam.samples}


def make_cfg(tmp_path: Path, **membership: Any) -> Any:
    data = local_config_free_ports()
    data["emulate_latency"] = False
    data["controller"]["state_path"] = str(tmp_path / "controller.sqlite")
    data["membership"] = {"drain_grace_s": 0.5,
                          "registration": {"enabled": True, "max_body_bytes": 1024, **membership}}
    return parse_config(data)


@pytest.fixture
async def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Api]:
    monkeypatch.setenv("SKYMESH_REGISTRATION_TOKEN", TOKEN)
    svc = ControllerService(make_cfg(tmp_path, regions=["us-east-1", "eu-west-1"],
                                     allowed_networks=["127.0.0.0/8", "10.0.0.0/8"]))
    await svc.start()
    try:
        async with aiohttp.ClientSession() as s:
            yield Api(svc, s)
    finally:
        await svc.stop()


def is_openai_error(doc: Any, status: int) -> bool:
    err = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(err, dict) and bool(err.get("message")) and bool(err.get("type")) and \
        err.get("code") is not None and "param" in err and status < 500


async def test_the_token_is_checked_first_and_in_its_own_right(api: Api) -> None:
    body = {"replica_id": "r-new", "url": "http://10.0.0.5:8000", "region": "us-east-1"}
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": admin_auth()["Authorization"]}):
        status, doc = await api.register(body, headers=headers)
        assert status == 401 and is_openai_error(doc, status), (headers, doc)
        assert doc["error"]["code"] == "invalid_registration_token"
    # a huge body without the token: 401 at once, none of it read or parsed
    status, doc = await api.call("POST", PATH, data=b"x" * (4 << 20), headers={"Authorization": "Bearer no"})
    assert status == 401
    status, doc = await api.call("DELETE", PATH + "/r-new", headers={"Authorization": "Bearer no"})
    assert status == 401
    assert "r-new" not in await api.topology()
    m = await api.metrics()
    assert m[("skymesh_membership_registrations_total", (("result", "unauthorized"),))] == 6


@pytest.mark.parametrize(("data", "headers", "status", "param"), [
    (b"x" * 2000, {}, 413, None),
    (gzip.compress(b" " * 100_000), {"Content-Encoding": "gzip"}, 413, None),
    (b"{", {}, 400, None),
    (b"\xff\xfe", {}, 400, None),
    (b"[1]", {}, 400, None),
    (b"null", {}, 400, None),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:8000", "region": "us-east-1", "x": 1}).encode(), {},
     400, "x"),
    (json.dumps({"replica_id": "a b", "url": "http://10.0.0.5:8000", "region": "us-east-1"}).encode(), {},
     400, "replica_id"),
    (json.dumps({"replica_id": "a\n", "url": "http://10.0.0.5:8000", "region": "us-east-1"}).encode(), {},
     400, "replica_id"),
    (json.dumps({"replica_id": 5, "url": "http://10.0.0.5:8000", "region": "us-east-1"}).encode(), {},
     400, "replica_id"),
    (json.dumps({"replica_id": "a", "url": "ftp://10.0.0.5:8000", "region": "us-east-1"}).encode(), {}, 400, "url"),
    (json.dumps({"replica_id": "a", "url": "http://u:p@10.0.0.5:8000", "region": "us-east-1"}).encode(), {},
     400, "url"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:8000/v1?x", "region": "us-east-1"}).encode(), {},
     400, "url"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:99999", "region": "us-east-1"}).encode(), {},
     400, "url"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:80 00", "region": "us-east-1"}).encode(), {},
     400, "url"),
    (json.dumps({"replica_id": "a", "url": ["x"], "region": "us-east-1"}).encode(), {}, 400, "url"),
    (json.dumps({"replica_id": "a", "url": "http://192.168.1.5:8000", "region": "us-east-1"}).encode(), {},
     403, "url"),
    (json.dumps({"replica_id": "a", "url": "http://replica.example:8000", "region": "us-east-1"}).encode(), {},
     403, "url"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:8000", "region": "mars-1"}).encode(), {},
     400, "region"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:8000", "region": "ap-northeast-1"}).encode(), {},
     403, "region"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:8000", "region": "us-east-1", "ttl_s": 0}).encode(), {},
     400, "ttl_s"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:8000", "region": "us-east-1", "ttl_s": True}).encode(),
     {}, 400, "ttl_s"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:8000", "region": "us-east-1",
                 "ttl_s": 1e9}).encode(), {}, 400, "ttl_s"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:8000", "region": "us-east-1",
                 "role": "kv_consumer"}).encode(), {}, 400, "role"),
    (json.dumps({"replica_id": "a", "url": "http://10.0.0.5:8000", "region": "us-east-1", "role": 1}).encode(),
     {}, 400, "role"),
    (b"{}", {"Content-Encoding": "br"}, 415, None),
])
async def test_bad_registrations_get_openai_shaped_4xx(api: Api, data: bytes, headers: dict[str, str],
                                                        status: int, param: str | None) -> None:
    got, doc = await api.call("POST", PATH, data=data, headers={**AUTH, **headers})
    assert got == status, doc
    assert is_openai_error(doc, got), doc
    if param is not None:
        assert doc["error"]["param"] == param, doc
    assert set(await api.topology()) == {rep.id for r in api.svc.cfg.regions for rep in r.replicas}


async def test_the_yaml_owns_its_ids_and_urls(api: Api) -> None:
    static = api.svc.cfg.regions[0].replicas[0]
    status, doc = await api.register({"replica_id": static.id, "url": "http://10.0.0.5:8000",
                                      "region": "us-east-1"})
    assert status == 403 and is_openai_error(doc, status)
    status, doc = await api.register({"replica_id": "copy", "url": static.url, "region": "us-east-1"})
    assert status == 409 and doc["error"]["param"] == "url"
    status, doc = await api.call("DELETE", f"{PATH}/{static.id}")
    assert status == 403
    status, doc = await api.call("DELETE", f"{PATH}/nobody")
    assert status == 404 and is_openai_error(doc, status)
    assert static.id in await api.topology()


async def test_register_drain_and_leave(api: Api) -> None:
    body = {"replica_id": "r-new", "url": "http://10.0.0.5:8000/", "region": "eu-west-1", "ttl_s": 60}
    status, doc = await api.register(body)
    assert status == 200, doc
    assert doc["url"] == "http://10.0.0.5:8000" and doc["state"] == "active"
    version = api.svc.version
    topo = await api.topology()
    assert topo["r-new"]["home_region"] == "eu-west-1" and not topo["r-new"]["draining"]
    # a renewal changes nothing: no new topology version
    assert (await api.register(body))[0] == 200
    assert api.svc.version == version
    m = await api.metrics()
    assert m[("skymesh_membership_replicas", (("region", "eu-west-1"), ("source", "registration")))] == 1
    assert m[("skymesh_membership_registrations_total", (("result", "renewed"),))] == 1

    status, doc = await api.call("POST", f"{PATH}/r-new/deregister")
    assert status == 200 and doc["state"] == "draining"
    topo = await api.topology()
    assert topo["r-new"]["draining"]
    m = await api.metrics()
    assert m[("skymesh_membership_draining", (("region", "eu-west-1"),))] == 1

    async def gone() -> bool:
        return "r-new" not in await api.topology()

    await wait_until(gone, "the drained replica left after drain_grace_s")
    m = await api.metrics()
    assert m[("skymesh_membership_draining", (("region", "eu-west-1"),))] == 0
    assert m[("skymesh_membership_drained_total", (("reason", "grace"),))] == 1


async def test_a_registered_replica_names_its_role_and_the_balancers_get_it(api: Api) -> None:
    body = {"replica_id": "r-dec", "url": "http://10.0.0.7:8000", "region": "us-east-1", "role": "decode"}
    status, doc = await api.register(body)
    assert status == 200 and doc["role"] == "decode", doc
    assert (await api.topology())["r-dec"]["role"] == "decode"
    grpc_roles = {x.replica_id: x.role for b in api.svc.topology().balancers for x in b.replicas}
    assert grpc_roles["r-dec"] == "decode"
    # the YAML's replicas carry the config's role (both here) in the balancers' topology
    static = api.svc.cfg.regions[0].replicas[0]
    assert grpc_roles[static.id] == static.role == "both"
    # a renewal that changes the role is a change: a new topology version
    version = api.svc.version
    assert (await api.register({**body, "role": "prefill"}))[0] == 200
    assert api.svc.version > version and (await api.topology())["r-dec"]["role"] == "prefill"
    # no role named: both
    status, doc = await api.register({"replica_id": "r-any", "url": "http://10.0.0.8:8000", "region": "us-east-1"})
    assert status == 200 and doc["role"] == "both" and (await api.topology())["r-any"]["role"] == "both"


async def test_a_lease_not_renewed_drains(api: Api) -> None:
    status, _ = await api.register({"replica_id": "short", "url": "http://10.0.0.6:8000", "region": "us-east-1",
                                    "ttl_s": 1})
    assert status == 200
    seen_draining = False

    async def gone() -> bool:
        nonlocal seen_draining
        topo = await api.topology()
        if "short" in topo:
            seen_draining = seen_draining or topo["short"]["draining"]
            return False
        return True

    await wait_until(gone, "the lapsed lease drained and left")
    assert seen_draining


async def test_registration_off_and_no_token_fail_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYMESH_REGISTRATION_TOKEN", raising=False)
    body = {"replica_id": "r", "url": "http://10.0.0.5:8000", "region": "us-east-1"}
    for cfg, want in ((make_cfg(tmp_path), 401), (make_cfg(tmp_path, enabled=False), 403)):
        svc = ControllerService(cfg)
        await svc.start()
        try:
            async with aiohttp.ClientSession() as s:
                status, doc = await Api(svc, s).register(body, headers={"Authorization": "Bearer "})
                assert status == want and is_openai_error(doc, status), doc
                status, doc = await Api(svc, s).register(body)
                assert status == want, doc
        finally:
            await svc.stop()


async def test_the_token_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYMESH_REGISTRATION_TOKEN", raising=False)
    token_file = tmp_path / "registration-token"
    token_file.write_text(TOKEN + "\n")
    svc = ControllerService(make_cfg(tmp_path, token_file=str(token_file)))
    await svc.start()
    try:
        async with aiohttp.ClientSession() as s:
            status, doc = await Api(svc, s).register({"replica_id": "r", "url": "http://10.0.0.5:8000",
                                                      "region": "us-east-1"})
            assert status == 200, doc
    finally:
        await svc.stop()


async def test_registrations_survive_a_controller_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart restores the registered replicas (a full lease each) and the draining
    ones, so the balancers do not lose them until their next renewal."""
    monkeypatch.setenv("SKYMESH_REGISTRATION_TOKEN", TOKEN)
    cfg = make_cfg(tmp_path)
    cfg = cfg.model_copy(update={"membership": cfg.membership.model_copy(update={"drain_grace_s": 600.0})})
    svc = ControllerService(cfg)
    await svc.start()
    try:
        async with aiohttp.ClientSession() as s:
            api = Api(svc, s)
            for rid, port in (("stays", 8001), ("leaves", 8002)):
                status, doc = await api.register({"replica_id": rid, "url": f"http://10.0.0.5:{port}",
                                                  "region": "eu-west-1", "ttl_s": 60, "role": "prefill"})
                assert status == 200, doc
            assert (await api.call("DELETE", f"{PATH}/leaves"))[0] == 200
    finally:
        await svc.stop()
    svc = ControllerService(cfg)
    await svc.start()
    try:
        async with aiohttp.ClientSession() as s:
            topo = await Api(svc, s).topology()
        assert topo["stays"]["url"] == "http://10.0.0.5:8001" and not topo["stays"]["draining"]
        assert topo["stays"]["role"] == "prefill"  # its role was saved with it
        assert topo["leaves"]["draining"]
        lease = next(m for m in svc.membership.status_json() if m["replica_id"] == "stays")["lease_left_s"]
        assert 0 < lease <= 60
    finally:
        await svc.stop()


async def test_other_methods_and_paths_are_openai_shaped(api: Api) -> None:
    for method, path, want in (("GET", PATH, 405), ("PUT", PATH + "/x", 405),
                               ("POST", PATH + "/x/y/z", 404), ("GET", "/membership/v1/other", 404)):
        status, doc = await api.call(method, path)
        assert status == want and is_openai_error(doc, status), (method, path, status, doc)
    # a path-encoded id that is not a replica id (a newline) is a 400, not a lookup
    status, doc = await api.call("DELETE", PATH + "/bad%0A")
    assert status == 400 and doc["error"]["param"] == "replica_id"
