"""Peer forwards under mesh identity: balancer-to-balancer HTTP goes over TLS with client
certificates from the mesh CA, to a peer listener that is the only place forwards are
accepted, and the origin region a forward claims is bound to the sender's certificate.

The attacks replayed: a recording relay between two balancers looks for the peer token
and the prompt in the bytes of a real forward; a holder of eu-west-1's certificate (and
the peer token) claims an ap-northeast-1 origin to get around EU residency; the same
forward sent to the plain client port; callers without a mesh-CA certificate, and with a
mesh certificate that is no balancer's. Real balancers, TLS and gRPC on loopback;
certificates from skymesh.security.pki (what `skymesh up` issues).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.peer_capture import RecordingRelay
from skymesh.balancer.request_flow import HOP_HEADER, ORIGIN_HEADER, TOKEN_HEADER
from skymesh.balancer.server import Balancer
from skymesh.balancer.services import ControllerLink, attach_services
from skymesh.config import ConfigError, MeshConfig, parse_config
from skymesh.proto_gen import mesh_pb2
from skymesh.runtime.procs import free_port
from skymesh.security.pki import (
    balancer_server_name,
    generate_mesh_pki,
    peer_tls,
)
from tests.mesh_helpers import report_figures
from tests.test_balancer_faults import FakeReplica

pytestmark = [pytest.mark.timeout(90), pytest.mark.fault]

US, EU, AP = "us-east-1", "eu-west-1", "ap-northeast-1"
SECRET_PROMPT = "the quarterly figures of ACME-7f3a9c, strictly confidential " * 4


def region(name: str, net: str, replica_url: str, **balancer: str) -> dict[str, Any]:
    return {
        "name": name, "source_networks": [net],
        "balancer": {"listen": f"127.0.0.1:{free_port()}", "grpc_listen": f"127.0.0.1:{free_port()}",
                     "peer_listen": f"127.0.0.1:{free_port()}", **balancer},
        "replicas": [{"id": f"{name}-r0", "url": replica_url}],
    }


def mesh_config(tmp_path: Path, regions: list[dict[str, Any]], *, tls: bool = True) -> MeshConfig:
    names = [r["name"] for r in regions]
    one_way = {(US, EU): 40, (US, AP): 80, (EU, AP): 110}
    data: dict[str, Any] = {
        "model": "skymesh-sim",
        "regions": regions,
        "latencies": [{"regions": list(k), "one_way_ms": v} for k, v in one_way.items()
                      if k[0] in names and k[1] in names],
        "controller": {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}"},
        "dns": {"name": "llm.skymesh.local", "listen": f"127.0.0.1:{free_port(span=2)}"},
        "policy": {"name": "round_robin", "ttft_slo_s": 2.0, "probe_interval_s": 0.05},
        "offload": {"enabled": True, "trigger": "saturated", "heartbeat_interval_s": 0.05,
                    "rules": [{"from": "eu-*", "to": ["eu-*"]}]},
        "health": {"unhealthy_threshold": 1},
        "emulate_latency": False,
    }
    if tls:
        data["tls"] = generate_mesh_pki(tmp_path / "pki", names)
    return parse_config(data)


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeReplica]]:
    made: list[FakeReplica] = []
    yield made
    await asyncio.gather(*(r.stop() for r in made))


async def started(cfg: MeshConfig, name: str, *, peers: bool = False) -> Balancer:
    b = Balancer(cfg, name)
    attach_services(b, peers=peers, controller=False)
    await b.start(port=0)
    return b


def body(prompt: str = SECRET_PROMPT) -> dict[str, Any]:
    return {"model": "skymesh-sim", "prompt": prompt, "max_tokens": 4}


async def wait_for(check: Any, what: str) -> None:
    for _ in range(400):
        if check():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never: {what}")


def refused(b: Balancer) -> dict[str, float]:
    """skymesh_rejected_peer_calls_total by reason, as /metrics exposes it."""
    text = generate_latest(b.metrics.registry).decode()
    return {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "skymesh_rejected_peer_calls_total"}


# ----------------------------------------------------------------------------- (a) capture


async def test_a_captured_forward_shows_neither_the_peer_token_nor_the_prompt(
    tmp_path: Path, fakes: list[FakeReplica]
) -> None:
    eu_replica = FakeReplica("eu0")
    fakes.append(eu_replica)
    await eu_replica.start()
    relay_port = free_port()
    # us-east-1's only replica is down: its requests go to eu-west-1, whose peer listener
    # us-east-1 reaches (by eu-west-1's advertised peer address) through the relay
    eu = region(EU, "127.2.0.0/16", eu_replica.url, peer_advertise=f"127.0.0.1:{relay_port}")
    us = region(US, "127.1.0.0/16", f"http://127.0.0.1:{free_port()}")
    cfg = mesh_config(tmp_path, [us, eu])
    eu_listen = cfg.region(EU).balancer.peer_listen
    assert eu_listen is not None
    relay = RecordingRelay(relay_port, (eu_listen.host, eu_listen.port))
    await relay.start()
    balancers: list[Balancer] = []
    try:
        balancers += [await started(cfg, EU, peers=True), await started(cfg, US, peers=True)]
        b_eu, b_us = balancers
        loop = asyncio.get_running_loop()
        await wait_for(lambda: EU in b_us.core.offload.candidates(loop.time()), "eu-west-1 is an offload target")
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(f"http://127.0.0.1:{b_us.bound_port}/v1/completions", json=body()) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Skymesh-Offloaded"] == "1" and r.headers["X-Skymesh-Region"] == EU
                    assert (await r.json())["choices"][0]["text"] == "eu0"
        assert eu_replica.received == 3 and b_eu.offloaded_in == 3
        captured = bytes(relay.captured)
        token_hits = captured.count(b_us.peer_token.encode())
        prompt_hits = captured.count(SECRET_PROMPT.encode()) + captured.count(b"ACME-7f3a9c")
        header_hits = captured.count(HOP_HEADER.encode()) + captured.count(b"/v1/completions")
        # the relay carried the forwards (and a TLS handshake), yet none of it reads
        assert relay.connections >= 1 and len(captured) > 3 * len(SECRET_PROMPT)
        assert token_hits == 0 and prompt_hits == 0 and header_hits == 0
        report_figures("peer_forward_capture", forwards=3, bytes_captured=len(captured),
                       connections=relay.connections, token_matches=token_hits, prompt_matches=prompt_hits,
                       header_matches=header_hits)
    finally:
        for b in reversed(balancers):
            await b.stop()
        await relay.stop()


# ----------------------------------------------------------------------------- (b) origin binding


def peer_client(cfg: MeshConfig, as_region: str) -> ssl.SSLContext:
    tls = peer_tls(cfg, as_region)
    assert tls is not None
    return tls.client


async def forward(b: Balancer, ctx: ssl.SSLContext | None, origin: str, token: str | None = None,
                  port: int | None = None) -> tuple[int, dict[str, Any]]:
    """A forward to ``b``'s peer listener (TLS with ``ctx``), or to ``port`` in clear."""
    headers = {HOP_HEADER: "1", TOKEN_HEADER: token or b.peer_token, ORIGIN_HEADER: origin}
    async with aiohttp.ClientSession() as s:
        if port is not None:
            url, kw = f"http://127.0.0.1:{port}/v1/completions", {}
        else:
            url = f"https://127.0.0.1:{b.peer_port}/v1/completions"
            kw = {"ssl": ctx, "server_hostname": balancer_server_name(b.region)}
        async with s.post(url, json=body("forged origin"), headers=headers, **kw) as r:
            return r.status, await r.json()


async def test_an_origin_not_bound_to_the_senders_certificate_is_refused(
    tmp_path: Path, fakes: list[FakeReplica]
) -> None:
    us_replica = FakeReplica("us0")
    fakes.append(us_replica)
    await us_replica.start()
    cfg = mesh_config(tmp_path, [region(US, "127.1.0.0/16", us_replica.url),
                                 region(EU, "127.2.0.0/16", f"http://127.0.0.1:{free_port()}"),
                                 region(AP, "127.3.0.0/16", f"http://127.0.0.1:{free_port()}")])
    b = await started(cfg, US)
    try:
        await wait_for(lambda: all(v.healthy for v in b.core.view.replicas.values()), "us0 healthy")
        eu_cert = peer_client(cfg, EU)
        # an EU balancer's certificate and the peer token, claiming an Asian origin (whose
        # rules allow us-east-1's replicas): refused, 10 of 10, and never served
        results = [await forward(b, eu_cert, AP) for _ in range(10)]
        assert [st for st, _ in results] == [403] * 10
        assert results[0][1]["error"]["code"] == "origin_not_bound_to_certificate"
        assert us_replica.received == 0
        assert refused(b).get("wrong_origin") == 10
        # its own region it may claim (residency then keeps it off us-east-1's replicas)
        status, _ = await forward(b, eu_cert, EU)
        assert status != 403 and us_replica.received == 0
        # ap-northeast-1's own balancer may claim ap-northeast-1
        status, _ = await forward(b, peer_client(cfg, AP), AP)
        assert status == 200 and us_replica.received == 1
        # once the controller hands eu-west-1 ap-northeast-1's replicas, it may claim that origin
        link = ControllerLink(b.controller_link_port)
        link.apply_topology(mesh_pb2.Topology(version=1, balancers=[
            mesh_pb2.BalancerAssignment(region=US, alive=True, replicas=[
                mesh_pb2.ReplicaAssignment(replica_id=f"{US}-r0", url=us_replica.url, home_region=US)]),
            mesh_pb2.BalancerAssignment(region=EU, alive=True, replicas=[
                mesh_pb2.ReplicaAssignment(replica_id=f"{AP}-r0", url="http://127.0.0.1:9", home_region=AP)]),
        ]))
        assert b.peer_mesh_port.allowed_origins(EU) == {EU, AP}
        status, _ = await forward(b, eu_cert, AP)
        assert status == 200 and us_replica.received == 2
    finally:
        await b.stop()


# ----------------------------------------------------------------------------- (c) client port


async def test_a_forward_to_the_plain_client_port_is_refused(tmp_path: Path, fakes: list[FakeReplica]) -> None:
    us_replica = FakeReplica("us0")
    fakes.append(us_replica)
    await us_replica.start()
    cfg = mesh_config(tmp_path, [region(US, "127.1.0.0/16", us_replica.url),
                                 region(EU, "127.2.0.0/16", f"http://127.0.0.1:{free_port()}"),
                                 region(AP, "127.3.0.0/16", f"http://127.0.0.1:{free_port()}")])
    b = await started(cfg, US)
    try:
        await wait_for(lambda: all(v.healthy for v in b.core.view.replicas.values()), "us0 healthy")
        # the valid peer token, in clear on the client port, for every origin: refused
        for origin in (AP, EU, US) * 3:
            status, answer = await forward(b, None, origin, port=b.bound_port)
            assert status == 403 and answer["error"]["code"] == "forward_on_client_port"
        assert us_replica.received == 0 and refused(b).get("client_port") == 9
        # the client API itself still works there
        async with aiohttp.ClientSession() as s, s.post(
                f"http://127.0.0.1:{b.bound_port}/v1/completions", json=body("hello")) as r:
            assert r.status == 200 and us_replica.received == 1
    finally:
        await b.stop()


# ----------------------------------------------------------------------------- (d) no mesh certificate


async def test_only_peer_balancers_with_mesh_certificates_reach_the_peer_listener(
    tmp_path: Path, fakes: list[FakeReplica]
) -> None:
    us_replica = FakeReplica("us0")
    fakes.append(us_replica)
    await us_replica.start()
    cfg = mesh_config(tmp_path, [region(US, "127.1.0.0/16", us_replica.url),
                                 region(EU, "127.2.0.0/16", f"http://127.0.0.1:{free_port()}")])
    assert cfg.tls is not None
    b = await started(cfg, US)
    try:
        await wait_for(lambda: all(v.healthy for v in b.core.view.replicas.values()), "us0 healthy")
        # trusts the mesh CA but has no certificate of its own
        anonymous = ssl.create_default_context(cafile=cfg.tls.ca_cert)
        # a certificate naming eu-west-1 from a CA of the caller's own making
        rogue_files = generate_mesh_pki(tmp_path / "rogue", [EU])["balancers"][EU]
        rogue = ssl.create_default_context(cafile=cfg.tls.ca_cert)
        rogue.load_cert_chain(rogue_files["cert"], rogue_files["key"])
        failures = 0
        for ctx in (anonymous, rogue) * 3:
            with pytest.raises(aiohttp.ClientError):
                await forward(b, ctx, EU)
            failures += 1
        # plain HTTP to the TLS listener gets no answer either
        with pytest.raises(aiohttp.ClientError):
            await forward(b, None, EU, port=b.peer_port)
        # a certificate of the mesh CA that is no balancer's (the operator's admin client)
        admin = ssl.create_default_context(cafile=cfg.tls.ca_cert)
        assert cfg.tls.admin is not None
        admin.load_cert_chain(cfg.tls.admin.cert, cfg.tls.admin.key)
        status, answer = await forward(b, admin, EU)
        assert status == 403 and answer["error"]["code"] == "not_a_peer"
        assert us_replica.received == 0 and refused(b).get("not_a_peer") == 1
        # and the real eu-west-1 balancer's certificate gets in (residency aside)
        status, _ = await forward(b, peer_client(cfg, EU), EU)
        assert status not in (401, 403)
        report_figures("peer_listener_without_mesh_certificate", refused_handshakes=failures,
                       not_a_peer=1, reached_a_replica=us_replica.received)
    finally:
        await b.stop()


# ----------------------------------------------------------------------------- configuration


def test_a_mesh_that_offloads_needs_peer_listeners(tmp_path: Path) -> None:
    us = region(US, "127.1.0.0/16", "http://127.0.0.1:9")
    del us["balancer"]["peer_listen"]
    with pytest.raises(ConfigError, match=r"regions\[0\]\.balancer\.peer_listen"):
        mesh_config(tmp_path, [us, region(EU, "127.2.0.0/16", "http://127.0.0.1:9")], tls=False)


async def test_without_tls_the_peer_listener_must_be_loopback(tmp_path: Path) -> None:
    us = region(US, "127.1.0.0/16", "http://127.0.0.1:9", peer_listen=f"0.0.0.0:{free_port()}")
    cfg = mesh_config(tmp_path, [us, region(EU, "127.2.0.0/16", "http://127.0.0.1:9")], tls=False)
    b = Balancer(cfg, US)
    with pytest.raises(ConfigError, match="peer listener"):
        await b.start(port=0)
    with contextlib.suppress(Exception):
        await b.stop()
