"""The embedded DNS server answers real UDP/TCP queries by source network and ECS."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import dns.edns
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import pytest

from skymesh.config import parse_config
from skymesh.dns.embedded import EmbeddedDnsProvider, MeshDnsServer
from tests.mesh_helpers import admin_auth, local_config_free_ports

NAME = "llm.skymesh.local"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[MeshDnsServer]:
    cfg = parse_config(local_config_free_ports())
    srv = MeshDnsServer(cfg)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


def addr(srv: MeshDnsServer) -> tuple[str, int]:
    assert srv.cfg.dns.listen is not None
    return srv.cfg.dns.listen.host, srv.cfg.dns.listen.port


def balancer_ip(srv: MeshDnsServer, region: str) -> str:
    return srv.cfg.region(region).balancer.advertise.host


async def query(srv: MeshDnsServer, name: str, rdtype: str = "A", source: str = "127.0.0.1",
                tcp: bool = False, ecs: str | None = None) -> dns.message.Message:
    q = dns.message.make_query(name, rdtype)
    if ecs is not None:
        q.use_edns(0, options=[dns.edns.ECSOption(ecs, 24)])
    host, port = addr(srv)
    fn = dns.query.tcp if tcp else dns.query.udp
    return await asyncio.to_thread(fn, q, host, port=port, timeout=3, source=source)


def a_records(msg: dns.message.Message) -> list[str]:
    return [rr.address for rrset in msg.answer if rrset.rdtype == dns.rdatatype.A for rr in rrset]


@pytest.mark.parametrize(("source", "region"), [
    ("127.1.0.5", "us-east-1"), ("127.2.0.5", "eu-west-1"), ("127.3.0.5", "ap-northeast-1"),
])
async def test_each_source_network_gets_its_region(server: MeshDnsServer, source: str, region: str) -> None:
    for tcp in (False, True):
        msg = await query(server, NAME, source=source, tcp=tcp)
        assert msg.rcode() == dns.rcode.NOERROR
        assert a_records(msg) == [balancer_ip(server, region)]
        assert msg.answer[0].ttl == server.cfg.dns.ttl_s


async def test_ecs_overrides_the_source_and_is_echoed(server: MeshDnsServer) -> None:
    msg = await query(server, NAME, source="127.1.0.5", ecs="10.3.7.0")
    assert a_records(msg) == [balancer_ip(server, "ap-northeast-1")]
    ecs = [o for o in msg.options if isinstance(o, dns.edns.ECSOption)]
    assert ecs and ecs[0].address == "10.3.7.0" and ecs[0].scopelen == 16


async def test_unhealthy_balancer_answer_moves_to_nearest_healthy(server: MeshDnsServer) -> None:
    provider = EmbeddedDnsProvider(server.cfg)
    try:
        eps = list(server.endpoints.values())
        down = [dataclasses.replace(e, healthy=e.region != "eu-west-1") for e in eps]
        assert await provider.sync(down) is True
        assert await provider.sync(down) is False  # idempotent
        msg = await query(server, NAME, source="127.2.0.5")
        # eu-west-1 (down) is 40 ms from us-east-1 and 110 ms from ap-northeast-1
        assert a_records(msg) == [balancer_ip(server, "us-east-1")]
        assert await provider.sync(eps) is True
        assert a_records(await query(server, NAME, source="127.2.0.5")) == [balancer_ip(server, "eu-west-1")]
    finally:
        await provider.close()


async def test_srv_region_names_nxdomain_refused(server: MeshDnsServer) -> None:
    srv = await query(server, f"_http._tcp.{NAME}", "SRV", source="127.3.0.9")
    rr = srv.answer[0][0]
    assert rr.port == server.cfg.region("ap-northeast-1").balancer.advertise.port
    assert str(rr.target).startswith("ap-northeast-1.")
    assert a_records(await query(server, f"eu-west-1.{NAME}")) == [balancer_ip(server, "eu-west-1")]
    assert (await query(server, f"nope.{NAME}")).rcode() == dns.rcode.NXDOMAIN
    assert (await query(server, "example.com")).rcode() == dns.rcode.REFUSED
    soa = await query(server, NAME, "SOA")
    assert soa.answer and soa.answer[0].rdtype == dns.rdatatype.SOA


async def test_malformed_packets_do_not_break_the_server(server: MeshDnsServer) -> None:
    host, port = addr(server)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for junk in (b"", b"\x00", b"\xff" * 40, b"\x12\x34" + b"\x01" * 10):
            s.sendto(junk, (host, port))
    msg = await query(server, NAME, source="127.1.0.5")
    assert a_records(msg) == [balancer_ip(server, "us-east-1")]


async def test_control_endpoint_requires_the_token(server: MeshDnsServer) -> None:
    import aiohttp

    host, port = addr(server)
    url = f"http://{host}:{port + 1}/v1/endpoints"
    async with aiohttp.ClientSession() as s:
        for auth in ({}, {"Authorization": "Bearer " + "x" * len(server.peer_token)}):
            async with s.put(url, json=[], headers=auth) as r:
                # OpenAI-shaped, as every skymesh error; the same code as the peer listener's
                assert r.status == 401
                assert await r.json() == {"error": {
                    "message": "request without a valid peer token", "type": "authentication_error",
                    "param": None, "code": "invalid_peer_token"}}


async def test_ecs_with_source_prefix_zero_falls_back_to_the_source(server: MeshDnsServer) -> None:
    q = dns.message.make_query(NAME, "A")
    q.use_edns(0, options=[dns.edns.ECSOption("0.0.0.0", 0)])
    host, port = addr(server)
    msg = await asyncio.to_thread(dns.query.udp, q, host, port=port, timeout=3, source="127.3.0.5")
    assert a_records(msg) == [balancer_ip(server, "ap-northeast-1")]
    ecs = [o for o in msg.options if isinstance(o, dns.edns.ECSOption)]
    assert ecs and ecs[0].scopelen == 0


async def test_unknown_clients_get_the_first_region_and_none_healthy_fails_open(server: MeshDnsServer) -> None:
    # 127.9.0.5 is in no region's source_networks: the first region of the config
    first = server.cfg.regions[0].name
    assert a_records(await query(server, NAME, source="127.9.0.5")) == [balancer_ip(server, first)]
    provider = EmbeddedDnsProvider(server.cfg)
    try:
        eps = list(server.endpoints.values())
        assert await provider.sync([dataclasses.replace(e, healthy=False) for e in eps]) is True
        # nobody healthy: still the client's own (nearest) balancer rather than no answer
        assert a_records(await query(server, NAME, source="127.2.0.5")) == [balancer_ip(server, "eu-west-1")]
        only_ap = [dataclasses.replace(e, healthy=e.region == "ap-northeast-1") for e in eps]
        assert await provider.sync(only_ap) is True
        for source in ("127.1.0.5", "127.2.0.5", "127.3.0.5"):
            msg = await query(server, NAME, source=source, tcp=True)
            assert a_records(msg) == [balancer_ip(server, "ap-northeast-1")]
    finally:
        await provider.close()


async def test_malformed_tcp_frames_and_bad_control_bodies_are_harmless(server: MeshDnsServer) -> None:
    import aiohttp

    host, port = addr(server)
    for junk in (b"\x00\x05\xff\xff\xff\xff\xff", b"\x00\x02\x00", b"\xff\xff" + b"\x00" * 10):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(junk)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    url = f"http://{host}:{port + 1}/v1/endpoints"
    auth = {"Authorization": f"Bearer {server.peer_token}"}
    async with aiohttp.ClientSession() as s:
        for body in (b"not json", b'{"a": 1}', b'[{"region": "x"}]', b"[1, 2]"):
            async with s.put(url, data=body, headers=auth) as r:
                assert r.status == 400
                error = (await r.json())["error"]
                assert error["code"] == "invalid_endpoint_list" and error["type"] == "invalid_request_error"
                assert error["message"].startswith("bad endpoint list: ")
        async with s.get(url, headers=admin_auth()) as r:
            assert {e["region"] for e in await r.json()} == {r.name for r in server.cfg.regions}
    for tcp in (False, True):
        assert a_records(await query(server, NAME, source="127.1.0.5", tcp=tcp)) == [balancer_ip(server, "us-east-1")]


async def test_long_udp_answers_are_truncated_for_a_tcp_retry(
    server: MeshDnsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dns.flags
    import dns.rrset

    # the mesh's own answers are small; make the apex answer 100 A records to get past 512
    many = dns.rrset.from_text_list(NAME + ".", 5, "IN", "A", [f"10.9.0.{i}" for i in range(1, 101)])
    monkeypatch.setattr(server, "_records", lambda qname, qtype, region: [many])
    for tcp in (False, True):
        msg = await query(server, NAME, source="127.1.0.5", tcp=tcp)
        if tcp:
            assert not msg.flags & dns.flags.TC and len(a_records(msg)) == 100
        else:
            assert msg.flags & dns.flags.TC and not msg.answer
    q = dns.message.make_query(NAME, "A", use_edns=0, payload=4096)
    host, port = addr(server)
    msg = await asyncio.to_thread(dns.query.udp, q, host, port=port, timeout=3, source="127.1.0.5")
    assert not msg.flags & dns.flags.TC and len(a_records(msg)) == 100  # fits a 4096-byte buffer


async def test_a_failing_lookup_answers_servfail_and_the_server_lives_on(
    server: MeshDnsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(qname: object, qtype: object, region: str) -> None:
        raise RuntimeError("lookup bug")

    with monkeypatch.context() as m:
        m.setattr(server, "_records", boom)
        for tcp in (False, True):
            assert (await query(server, NAME, source="127.1.0.5", tcp=tcp)).rcode() == dns.rcode.SERVFAIL
    for tcp in (False, True):
        assert a_records(await query(server, NAME, source="127.1.0.5", tcp=tcp)) == [balancer_ip(server, "us-east-1")]


# ----------------------------------------------------------------------------- hostile packets


def dropped_by_reason(page: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(page)
            for s in fam.samples if s.name == "skymesh_dns_dropped_packets_total"}


@pytest.mark.fault
async def test_response_truncated_and_malformed_packets_are_dropped_counted_and_not_logged(
        tmp_path: Path) -> None:
    import aiohttp
    import yaml

    from skymesh.runtime.procs import Child, skymesh_cmd
    from tests.mesh_helpers import report_figures

    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(local_config_free_ports()))
    child = Child("dns", skymesh_cmd("dns", "--config", str(path), "--port", "0", "--log-level", "INFO"), tmp_path)
    child.start()
    try:
        ports = await child.wait_ready(within_s=60)
        host = "127.0.0.1"
        metrics_url = f"http://{host}:{ports['control']}/metrics"
        async with aiohttp.ClientSession() as s, s.get(metrics_url) as r:
            assert r.status == 200
            before = dropped_by_reason(await r.text())
        log_start = child.log_path.stat().st_size
        query = dns.message.make_query(NAME, "A")
        response = dns.message.make_response(query).to_wire()  # QR set: 35 bytes
        assert response[2] & 0x80 and len(response) == 35
        wire = query.to_wire()
        bad = {
            "response": [response, response[:20] + b"\x00" * 20, b"\xff" * 40],
            "truncated": [b"", b"\x00", wire[:11]],
            "malformed": [wire[:20], wire + b"junk", b"\x12\x34\x01\x00" + b"\x00\x05" + b"\x01" * 30],
        }
        sent = sum(len(v) for v in bad.values())
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for packets in bad.values():
                for p in packets:
                    sock.sendto(p, (host, ports["dns"]))
        # one socket, one loop: once a query sent after them is answered, all were handled
        msg = await asyncio.to_thread(dns.query.udp, query, host, port=ports["dns"], timeout=10,
                                      source="127.1.0.5")
        assert msg.rcode() == dns.rcode.NOERROR and a_records(msg)
        async with aiohttp.ClientSession() as s, s.get(metrics_url) as r:
            after = dropped_by_reason(await r.text())
        logged = child.log_path.read_bytes()[log_start:]
        for reason, packets in bad.items():
            assert after[reason] - before.get(reason, 0.0) == len(packets), (reason, before, after)
        assert after["error"] == before.get("error", 0.0) == 0
        assert b"Traceback" not in logged
        levels = [json.loads(line)["level"] for line in logged.decode().splitlines() if line.startswith("{")]
        assert not {"warning", "error", "critical"} & set(levels), logged.decode()[:2000]
        report_figures("dns_hostile_packets", packets=sent, log_bytes=len(logged),
                       log_bytes_per_bad_packet=len(logged) / sent)
        assert child.running()
    finally:
        await child.stop()
