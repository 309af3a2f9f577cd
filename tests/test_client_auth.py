"""Client API keys, per-key limits, the peer token and the origin label, the admin token
on /admin/* and /metrics, and slow-client (slowloris) bounds at the balancer."""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import skymesh.balancer.auth as auth_mod
import skymesh.security.admin_auth as admin_auth_mod
from skymesh.balancer.auth import ClientKeyring
from skymesh.balancer.ratelimit import TokenBucket, retry_after_header
from skymesh.balancer.request_flow import HOP_HEADER, ORIGIN_HEADER, TOKEN_HEADER
from skymesh.balancer.server import Balancer
from skymesh.config import ClientAuthConfig, ConfigError, parse_config
from tests.mesh_helpers import admin_auth, one_region_config
from tests.test_balancer_faults import FakeReplica, start_balancer

pytestmark = pytest.mark.timeout(60)

KEY = "sk-test-alpha"
OTHER_KEY = "sk-test-beta"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# ----------------------------------------------------------------------------- token bucket


def test_bucket_starts_full_and_refuses_past_its_capacity() -> None:
    b = TokenBucket(rate=2.0, capacity=3.0)
    assert [b.try_take(0.0) for _ in range(4)] == [True, True, True, False]
    # 0 tokens, 2 per second: one token in 0.5 s
    assert b.wait_s(0.0) == pytest.approx(0.5)


def test_bucket_refills_at_its_rate_up_to_its_capacity() -> None:
    b = TokenBucket(rate=2.0, capacity=3.0)
    for _ in range(3):
        assert b.try_take(0.0)
    assert not b.try_take(0.4)  # 0.8 tokens
    assert b.try_take(0.5)  # 1.0 token
    assert not b.try_take(0.5)
    assert b.try_take(100.0, 3.0)  # full again, never more than capacity
    assert not b.try_take(100.0, 0.5)


def test_bucket_refusal_takes_nothing_and_costs_count() -> None:
    b = TokenBucket(rate=10.0, capacity=100.0)
    assert not b.try_take(0.0, 101.0)
    assert b.tokens == 100.0
    assert b.try_take(0.0, 60.0)
    assert b.wait_s(0.0, 60.0) == pytest.approx(2.0)  # 20 missing at 10/s
    assert math.isinf(b.wait_s(0.0, 101.0))  # more than it ever holds


def test_bucket_ignores_a_clock_going_backwards() -> None:
    b = TokenBucket(rate=1.0, capacity=1.0)
    assert b.try_take(10.0)
    assert not b.try_take(5.0)  # no refill (nor negative refill) from an older `now`
    assert b.try_take(11.0)


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert retry_after_header(0.0) == "1"
    assert retry_after_header(0.2) == "1"
    assert retry_after_header(1.01) == "2"
    assert retry_after_header(7.0) == "7"


# ----------------------------------------------------------------------------- keys and config


def test_keyring_from_yaml_hashes_file_and_env(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nteam-a:sk-file-a\nsk-file-anon  # unnamed\n\n")
    cfg = ClientAuthConfig.model_validate({
        "keys": [{"name": "alpha", "sha256": sha(KEY), "limits": {"requests_per_second": 5.0}}],
        "keys_file": str(key_file),
        "keys_env": "TEST_KEYS",
        "default_limits": {"prompt_tokens_per_minute": 1000},
    })
    ring = ClientKeyring.from_config(cfg, environ={"TEST_KEYS": "svc:sk-env-svc, sk-env-anon"})
    names = {k.name for k in ring.keys}
    assert names == {"alpha", "team-a", "keys_file-2", "svc", "keys_env-2"}
    found = ring.authenticate(KEY)
    assert found is not None and found.name == "alpha" and found.limits.requests_per_second == 5.0
    found = ring.authenticate("sk-env-svc")
    assert found is not None and found.name == "svc" and found.limits.prompt_tokens_per_minute == 1000
    assert ring.authenticate("sk-file-a") is not None
    assert ring.authenticate("sk-file-anon") is not None
    assert ring.authenticate("sk-file-anon  # unnamed") is None
    assert ring.authenticate("wrong") is None
    assert ring.authenticate(sha(KEY)) is None  # the digest is not the key


def test_keyring_compares_every_digest_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ClientAuthConfig.model_validate({
        "keys": [{"name": f"k{i}", "sha256": sha(f"key-{i}")} for i in range(4)], "keys_env": None,
    })
    ring = ClientKeyring.from_config(cfg, environ={})
    calls: list[tuple[bytes, bytes]] = []
    real = auth_mod.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", spy)
    found = ring.authenticate("key-0")
    assert found is not None and found.name == "k0"
    assert len(calls) == 4  # no early exit on the first (matching) digest


def test_no_keys_means_the_api_is_open() -> None:
    ring = ClientKeyring.from_config(ClientAuthConfig(), environ={})
    assert not ring.enabled


def test_unreadable_key_file_is_an_error_not_an_open_api(tmp_path: Path) -> None:
    cfg = ClientAuthConfig.model_validate({"keys_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError) as e:
        ClientKeyring.from_config(cfg, environ={})
    assert e.value.path == "client_auth.keys_file"


@pytest.mark.parametrize(
    ("client_auth", "path"),
    [
        ({"keys": [{"name": "a", "sha256": "abc"}]}, "client_auth.keys[0].sha256"),
        ({"keys": [{"name": "a", "sha256": sha("x").upper()}]}, "client_auth.keys[0].sha256"),
        ({"keys": [{"name": "a", "sha256": sha("x")}, {"name": "a", "sha256": sha("y")}]}, "client_auth.keys[1].name"),
        ({"keys": [{"name": "a", "sha256": sha("x")}, {"name": "b", "sha256": sha("x")}]},
         "client_auth.keys[1].sha256"),
        ({"keys": [{"name": "a", "sha256": sha("x"), "key": "x"}]}, "client_auth.keys[0].key"),
        ({"default_limits": {"requests_per_second": 0}}, "client_auth.default_limits.requests_per_second"),
        ({"keys_env": "not a var"}, "client_auth.keys_env"),
    ],
)
def test_client_auth_config_errors_name_the_path(client_auth: dict[str, Any], path: str) -> None:
    data = one_region_config({"r0": "http://127.0.0.1:9"}, 18000, 18001)
    data["client_auth"] = client_auth
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.path == path


def test_admin_and_timeouts_config_errors_name_the_path() -> None:
    for section, value, path in (
        ("admin", {"metrics_access": "everyone"}, "admin.metrics_access"),
        ("client_timeouts", {"header_timeout_s": 0}, "client_timeouts.header_timeout_s"),
    ):
        data = one_region_config({"r0": "http://127.0.0.1:9"}, 18000, 18001)
        data[section] = value
        with pytest.raises(ConfigError) as e:
            parse_config(data)
        assert e.value.path == path


# ----------------------------------------------------------------------------- the balancer


@pytest.fixture
async def replica() -> AsyncIterator[FakeReplica]:
    r = FakeReplica("r0")
    await r.start()
    yield r
    await r.stop()


def keyed(limits: dict[str, Any] | None = None) -> dict[str, Any]:
    key = {"name": "alpha", "sha256": sha(KEY)}
    if limits is not None:
        key["limits"] = limits
    return {"keys": [key], "keys_env": None}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(tokens: int = 8) -> dict[str, Any]:
    # without a tokenizer the balancer counts 4 UTF-8 bytes as one token
    return {"model": "skymesh-sim", "prompt": "abcd" * tokens, "max_tokens": 4}


async def post(b: Balancer, headers: dict[str, str] | None = None, payload: dict[str, Any] | None = None,
               port: int | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``port``: another of the balancer's ports (its peer listener); default the client port."""
    async with aiohttp.ClientSession() as s, s.post(
        f"http://127.0.0.1:{port or b.bound_port}/v1/completions", json=payload or body(), headers=headers or {}
    ) as r:
        return r.status, await r.json(), dict(r.headers)


async def test_without_keys_the_api_stays_open(replica: FakeReplica) -> None:
    b = await start_balancer([replica])
    try:
        status, _, headers = await post(b)
        assert status == 200 and headers["X-Skymesh-Replica"] == "r0"
    finally:
        await b.stop()


async def test_keys_configured_missing_or_wrong_key_is_an_openai_401(replica: FakeReplica) -> None:
    b = await start_balancer([replica], client_auth=keyed())
    try:
        for headers in ({}, bearer(OTHER_KEY), {"Authorization": KEY}, bearer(sha(KEY))):
            status, doc, _ = await post(b, headers)
            assert status == 401, headers
            assert doc["error"]["type"] == "invalid_request_error"
            assert doc["error"]["code"] == "invalid_api_key"
            assert KEY not in doc["error"]["message"]
        assert replica.received == 0
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{b.bound_port}/v1/models") as r:
            assert r.status == 401
        status, _, headers = await post(b, bearer(KEY))
        assert status == 200 and headers["X-Skymesh-Replica"] == "r0"
        assert replica.received == 1
        async with aiohttp.ClientSession() as s, s.get(
            f"http://127.0.0.1:{b.bound_port}/v1/models", headers=bearer(KEY)
        ) as r:
            assert r.status == 200
    finally:
        await b.stop()


async def test_requests_per_second_limit_gives_429_with_retry_after(replica: FakeReplica) -> None:
    # 0.1/s, burst 2: the third request at once waits ~10 s for its token
    b = await start_balancer([replica], client_auth=keyed({"requests_per_second": 0.1, "request_burst": 2}))
    try:
        statuses = [(await post(b, bearer(KEY)))[0] for _ in range(2)]
        assert statuses == [200, 200]
        status, doc, headers = await post(b, bearer(KEY))
        assert status == 429
        assert doc["error"]["code"] == "rate_limit_exceeded" and doc["error"]["type"] == "requests"
        assert 9 <= int(headers["Retry-After"]) <= 10
        assert replica.received == 2
    finally:
        await b.stop()


async def test_prompt_tokens_per_minute_limit_gives_429(replica: FakeReplica) -> None:
    b = await start_balancer([replica], client_auth=keyed({"prompt_tokens_per_minute": 60}))
    try:
        status, _, _ = await post(b, bearer(KEY), body(tokens=40))  # 40 of 60 tokens
        assert status == 200
        status, doc, headers = await post(b, bearer(KEY), body(tokens=40))
        assert status == 429 and doc["error"]["type"] == "tokens"
        # ~20 tokens left, 1 token/s: the next 40-token prompt fits in about 20 s
        assert 10 <= int(headers["Retry-After"]) <= 30
        status, doc, headers = await post(b, bearer(KEY), body(tokens=500))  # can never fit
        assert status == 429 and "Retry-After" not in headers
        assert replica.received == 1
    finally:
        await b.stop()


async def test_forwarded_requests_need_the_peer_token_compared_in_constant_time(
    replica: FakeReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = await start_balancer([replica], peer_listener=True, client_auth=keyed())
    compared: list[bytes] = []
    real = admin_auth_mod.hmac.compare_digest

    def spy(a: bytes, c: bytes) -> bool:
        compared.append(c)
        return real(a, c)

    # the one check of the peer token (admin_auth.peer_token_denied)
    monkeypatch.setattr(admin_auth_mod.hmac, "compare_digest", spy)
    try:
        status, doc, headers = await post(b, {HOP_HEADER: "1", TOKEN_HEADER: "guess"}, port=b.peer_port)
        assert status == 401 and doc["error"]["code"] == "invalid_peer_token"
        assert doc["error"]["type"] == "authentication_error"
        assert headers["Connection"] == "close"  # its body is never read
        # no hop header: not a forward, nothing the peer listener serves (a 404 typed as every 404)
        status, doc, _ = await post(b, {TOKEN_HEADER: b.peer_token}, port=b.peer_port)
        assert status == 404 and doc["error"]["code"] == "not_found"
        assert doc["error"]["type"] == "not_found_error"
        status, _, _ = await post(b, {HOP_HEADER: "1", TOKEN_HEADER: b.peer_token, ORIGIN_HEADER: "x"},
                                  port=b.peer_port)
        # past the token (a peer's request carries no client key): refused only because
        # "x" is no configured peer region (residency is checked by the origin)
        assert status == 400
        assert b.peer_token.encode() in compared
    finally:
        await b.stop()


async def test_the_origin_label_is_only_ever_a_configured_region(replica: FakeReplica) -> None:
    b = await start_balancer([replica], peer_listener=True)
    try:
        peer = {HOP_HEADER: "1", TOKEN_HEADER: b.peer_token}
        for i in range(20):
            # an origin that names no configured peer region is refused outright
            status, _, _ = await post(b, {**peer, ORIGIN_HEADER: f"attacker-{i}"}, port=b.peer_port)
            assert status == 400
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{b.bound_port}/metrics") as r:
            text = await r.text()
        regions = {sample.labels["peer"] for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == "skymesh_offloaded_total" and sample.labels.get("direction") == "in"}
        assert not any(r.startswith("attacker") for r in regions)
    finally:
        await b.stop()


async def test_admin_status_needs_the_admin_token(replica: FakeReplica) -> None:
    b = await start_balancer([replica])
    url = f"http://127.0.0.1:{b.bound_port}/admin/status"
    try:
        async with aiohttp.ClientSession() as s:
            for headers in ({}, bearer("wrong"), {"Authorization": admin_auth()["Authorization"].split()[1]}):
                async with s.get(url, headers=headers) as r:
                    assert r.status == 401
                    assert (await r.json())["error"]["code"] == "invalid_admin_token"
            async with s.get(url, headers=admin_auth()) as r:
                assert r.status == 200 and (await r.json())["region"] == "us-east-1"
            async with s.get(f"http://127.0.0.1:{b.bound_port}/health") as r:
                assert r.status == 200  # liveness stays open
    finally:
        await b.stop()


async def test_no_admin_token_anywhere_fails_closed(replica: FakeReplica, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.delenv("SKYMESH_ADMIN_TOKEN")
    monkeypatch.chdir(tmp_path)  # no .skymesh/run/admin-token here
    b = await start_balancer([replica])
    try:
        async with aiohttp.ClientSession() as s:
            for headers in ({}, bearer("None"), bearer("")):
                async with s.get(f"http://127.0.0.1:{b.bound_port}/admin/status", headers=headers) as r:
                    assert r.status == 401
    finally:
        await b.stop()


async def test_metrics_open_on_loopback_by_default_and_token_when_configured(replica: FakeReplica) -> None:
    b = await start_balancer([replica])
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{b.bound_port}/metrics") as r:
            assert r.status == 200
    finally:
        await b.stop()
    b = await start_balancer([replica], admin={"metrics_access": "token"})
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{b.bound_port}/metrics") as r:
                assert r.status == 401
            async with s.get(f"http://127.0.0.1:{b.bound_port}/metrics", headers=admin_auth()) as r:
                assert r.status == 200
    finally:
        await b.stop()


# ----------------------------------------------------------------------------- slow clients


async def _read_all(reader: asyncio.StreamReader, within_s: float) -> bytes:
    async with asyncio.timeout(within_s):
        return await reader.read()


async def test_half_sent_headers_are_cut_after_the_header_timeout(replica: FakeReplica) -> None:
    b = await start_balancer([replica], client_timeouts={"header_timeout_s": 0.5, "body_timeout_s": 30})
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", b.bound_port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")
        await writer.drain()
        data = await _read_all(reader, 5.0)  # EOF: the server closed it
        assert loop.time() - t0 < 3.0
        assert b"200" not in data
        writer.close()
        assert replica.received == 0
    finally:
        await b.stop()


async def test_a_kept_alive_connection_sending_half_a_head_is_cut_too(replica: FakeReplica) -> None:
    b = await start_balancer([replica], client_timeouts={"header_timeout_s": 0.5, "body_timeout_s": 30})
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", b.bound_port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        writer.write(b"GET /health HTTP/1.1\r\nHo")
        await writer.drain()
        assert await _read_all(reader, 5.0) == b""
        writer.close()
    finally:
        await b.stop()


async def test_half_sent_body_gets_408_after_the_body_timeout(replica: FakeReplica) -> None:
    b = await start_balancer([replica], client_timeouts={"header_timeout_s": 5, "body_timeout_s": 0.5})
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", b.bound_port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        await writer.drain()
        data = await _read_all(reader, 5.0)
        assert loop.time() - t0 < 3.0
        assert data.startswith(b"HTTP/1.1 408"), data[:80]
        assert b"request_timeout" in data
        writer.close()
        assert replica.received == 0
        assert b.core.view.active_requests == 0
    finally:
        await b.stop()
