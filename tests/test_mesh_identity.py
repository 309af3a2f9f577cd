"""Mesh identity: mTLS on every gRPC channel, registrations bound to the certificate's
region, controller-issued epochs, heartbeats bound to the stream's authenticated peer.

The attacks found on main, replayed: a Register without a certificate, with another
region's certificate, with a certificate from a self-made CA, with a foreign address or a
huge epoch; heartbeats without a certificate or claiming another region with 1,000 free
replicas. Real gRPC on loopback; certificates from skymesh.security.pki (what `skymesh up` uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.service import ControllerService
from skymesh.balancer.services import ControllerLink, PeerMesh, rejected_peer_calls
from skymesh.config import ConfigError, MeshConfig, parse_config
from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from skymesh.security.pki import (
    CONTROLLER_SERVER_NAME,
    Credentials,
    balancer_server_name,
    generate_mesh_pki,
    load_credentials,
    secure_channel,
)
from tests.balancer_standin import StandInBalancer
from tests.mesh_helpers import free_port, local_config_free_ports, report_figures
from tests.test_balancer_services import INTERVAL_S
from tests.test_controller import wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.fault]

HUGE_EPOCH = 2**63


def identity_config(tmp_path: Path) -> MeshConfig:
    data = local_config_free_ports()
    data["emulate_latency"] = False
    data["controller"]["state_path"] = str(tmp_path / "state" / "controller.sqlite")
    data["tls"] = generate_mesh_pki(tmp_path / "pki", [r["name"] for r in data["regions"]])
    return parse_config(data)


def creds_of(cfg: MeshConfig, component: str) -> Credentials:
    creds = load_credentials(cfg, component)
    assert creds is not None
    return creds


def rogue_balancer_credentials(tmp_path: Path, real_ca: bytes) -> Credentials:
    """A us-east-1 balancer certificate from a CA of the caller's own making (the caller
    trusts the real CA, so only the controller's check of the client can stop it)."""
    rogue = generate_mesh_pki(tmp_path / "rogue", ["us-east-1"])["balancers"]["us-east-1"]
    return Credentials(real_ca, Path(rogue["cert"]).read_bytes(), Path(rogue["key"]).read_bytes())


def register_request(cfg: MeshConfig, region: str, **overrides: Any) -> Any:
    b = cfg.region(region).balancer
    fields = {"region": region, "balancer_id": f"{region}-b", "epoch": 1, "http_url": b.advertise_url,
              "grpc_address": str(b.grpc_advertise), "version": "test", **overrides}
    return mesh_pb2.RegisterRequest(**fields)


def snapshot(svc: ControllerService) -> tuple[Any, ...]:
    """What a forged call must not change: the balancers' records, the topology, DNS."""
    return (repr({name: s.record for name, s in svc.regions.items()}), svc.version, repr(svc.endpoints()))


@contextlib.asynccontextmanager
async def running_controller(cfg: MeshConfig) -> Any:
    svc = ControllerService(cfg)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


async def call_register(cfg: MeshConfig, channel: grpc.aio.Channel, request: Any) -> Any:
    async with channel:
        return await mesh_pb2_grpc.ControllerStub(channel).Register(request, timeout=5)


# ----------------------------------------------------------------------------- PKI and config


def test_generated_pki_is_private_reused_and_names_regions(tmp_path: Path) -> None:
    first = generate_mesh_pki(tmp_path / "pki", ["us-east-1", "eu-west-1"])
    key = Path(first["balancers"]["us-east-1"]["key"])
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "pki" / "ca.key").stat().st_mode) == 0o600
    before = key.read_bytes()
    assert generate_mesh_pki(tmp_path / "pki", ["us-east-1", "eu-west-1"]) == first
    assert key.read_bytes() == before  # reused, not reissued
    assert f"{balancer_server_name('us-east-1')}" in str(
        __import__("cryptography.x509", fromlist=["x"]).load_pem_x509_certificate(
            Path(first["balancers"]["us-east-1"]["cert"]).read_bytes()).extensions)


def test_tls_section_must_name_exactly_the_regions(tmp_path: Path) -> None:
    data = local_config_free_ports()
    data["tls"] = generate_mesh_pki(tmp_path / "pki", ["us-east-1"])
    with pytest.raises(ConfigError, match="tls.balancers: missing the certificate of region"):
        parse_config(data)
    data["tls"]["balancers"]["nowhere-1"] = data["tls"]["balancers"]["us-east-1"]
    data["tls"]["balancers"].update(generate_mesh_pki(tmp_path / "pki", [r["name"] for r in data["regions"]])
                                    ["balancers"])
    with pytest.raises(ConfigError, match="tls.balancers.nowhere-1: unknown region"):
        parse_config(data)
    data["tls"]["balancers"].pop("nowhere-1")
    data["tls"]["controler"] = {}
    with pytest.raises(ConfigError, match="tls.controler: unknown key"):
        parse_config(data)


def test_no_default_secrets_off_loopback(tmp_path: Path) -> None:
    data = local_config_free_ports()
    data["controller"]["listen"] = f"0.0.0.0:{free_port()}"
    data["controller"]["state_path"] = str(tmp_path / "c.sqlite")
    with pytest.raises(ConfigError, match="tls: the controller binds gRPC to 0.0.0.0, which is not loopback"):
        ControllerService(parse_config(data))


def test_a_missing_key_file_names_its_config_key(tmp_path: Path) -> None:
    cfg = identity_config(tmp_path)
    Path(cfg.tls.balancers["eu-west-1"].key).unlink()  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"tls.balancers.eu-west-1.key: cannot read"):
        load_credentials(cfg, "eu-west-1")


# ----------------------------------------------------------------------------- the controller


async def test_forged_registers_are_rejected_and_change_nothing(tmp_path: Path) -> None:
    cfg = identity_config(tmp_path)
    addr = str(cfg.controller.listen)
    real_ca = creds_of(cfg, "controller").ca_pem
    rogue_creds = rogue_balancer_credentials(tmp_path, real_ca)
    forged = register_request(cfg, "us-east-1", epoch=HUGE_EPOCH, http_url="http://203.0.113.7:80")
    async with running_controller(cfg) as svc:
        before = snapshot(svc)
        # no certificate at all: plaintext, and TLS without a client certificate
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_register(cfg, grpc.aio.insecure_channel(addr), forged)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        anonymous = grpc.aio.secure_channel(addr, grpc.ssl_channel_credentials(real_ca),
                                            options=[("grpc.ssl_target_name_override", CONTROLLER_SERVER_NAME)])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_register(cfg, anonymous, forged)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # a certificate for us-east-1 signed by a CA of the caller's own making
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_register(cfg, secure_channel(addr, rogue_creds, CONTROLLER_SERVER_NAME), forged)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # a real certificate, of another region
        eu = creds_of(cfg, "eu-west-1")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_register(cfg, secure_channel(addr, eu, CONTROLLER_SERVER_NAME),
                                register_request(cfg, "us-east-1", epoch=HUGE_EPOCH))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # us-east-1's own certificate, but an address the config does not give it
        use1 = creds_of(cfg, "us-east-1")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_register(cfg, secure_channel(addr, use1, CONTROLLER_SERVER_NAME), forged)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # a report for another region is refused too
        async with secure_channel(addr, eu, CONTROLLER_SERVER_NAME) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mesh_pb2_grpc.ControllerStub(ch).Report(
                    mesh_pb2.BalancerReport(region="us-east-1", epoch=HUGE_EPOCH, admin_json="{}"), timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # a deregistration (it would black the region out): without a certificate, with
        # another region's, and with the region's own but not its current registration
        forged_out = mesh_pb2.DeregisterRequest(region="us-east-1", balancer_id="", epoch=0, reason="forged")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await mesh_pb2_grpc.ControllerStub(grpc.aio.insecure_channel(addr)).Deregister(forged_out, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        async with secure_channel(addr, eu, CONTROLLER_SERVER_NAME) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mesh_pb2_grpc.ControllerStub(ch).Deregister(forged_out, timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with secure_channel(addr, use1, CONTROLLER_SERVER_NAME) as ch:
            reply = await mesh_pb2_grpc.ControllerStub(ch).Deregister(
                mesh_pb2.DeregisterRequest(region="us-east-1", balancer_id="not-the-one", epoch=HUGE_EPOCH), timeout=5)
            assert not reply.accepted
        assert snapshot(svc) == before
        assert svc.regions["us-east-1"].record.http_url == cfg.region("us-east-1").balancer.advertise_url
        # the refusals past the TLS handshake are counted on the controller's /metrics
        page = svc.metrics.render().decode()
        assert 'skymesh_controller_rejected_calls_total{reason="wrong_identity"} 3.0' in page.splitlines()
        assert 'skymesh_controller_rejected_calls_total{reason="wrong_address"} 1.0' in page.splitlines()
        assert 'skymesh_controller_rejected_calls_total{reason="stale_deregister"} 1.0' in page.splitlines()
        report_figures("forged_controller_calls", forged=9, rejected=9, state_changed=snapshot(svc) != before)


async def test_the_controller_issues_epochs_and_ignores_the_callers(tmp_path: Path) -> None:
    cfg = identity_config(tmp_path)
    addr = str(cfg.controller.listen)
    use1 = creds_of(cfg, "us-east-1")
    async with running_controller(cfg) as svc:
        reply = await call_register(cfg, secure_channel(addr, use1, CONTROLLER_SERVER_NAME),
                                    register_request(cfg, "us-east-1", epoch=HUGE_EPOCH))
        assert reply.accepted and reply.epoch == 1
        assert svc.regions["us-east-1"].record.epoch == 1
        # the real balancer (re)registers with a small epoch of its own: still accepted,
        # and its reports with the issued epoch count
        reply = await call_register(cfg, secure_channel(addr, use1, CONTROLLER_SERVER_NAME),
                                    register_request(cfg, "us-east-1", epoch=5, balancer_id="use1-real"))
        assert reply.epoch == 2
        async with secure_channel(addr, use1, CONTROLLER_SERVER_NAME) as ch:
            stub = mesh_pb2_grpc.ControllerStub(ch)
            await stub.Report(mesh_pb2.BalancerReport(region="us-east-1", balancer_id="use1-real",
                                                      epoch=HUGE_EPOCH, admin_json='{"n": 1}'), timeout=5)
            assert svc.regions["us-east-1"].last_admin == {"n": 1}
            assert svc.regions["us-east-1"].record.epoch == 2  # a larger claimed epoch is not believed
            await stub.Report(mesh_pb2.BalancerReport(region="us-east-1", balancer_id="use1-real",
                                                      epoch=reply.epoch, admin_json='{"n": 2}'), timeout=5)
            assert svc.regions["us-east-1"].last_admin == {"n": 2}
            # an older registration's report is stale
            await stub.Report(mesh_pb2.BalancerReport(region="us-east-1", epoch=1, admin_json='{"n": 3}'),
                              timeout=5)
            assert svc.regions["us-east-1"].last_admin == {"n": 2}
    # the issued epoch survives a controller restart: it never repeats
    async with running_controller(cfg):
        reply = await call_register(cfg, secure_channel(addr, use1, CONTROLLER_SERVER_NAME),
                                    register_request(cfg, "us-east-1"))
        assert reply.epoch == 3


# ----------------------------------------------------------------------------- heartbeats


def tls_balancer(cfg: MeshConfig, region: str, grpc_port: int, peers: dict[str, int]) -> StandInBalancer:
    balancer = cfg.region(region).balancer
    return StandInBalancer(region, grpc_port, peers, INTERVAL_S, controller_listen=str(cfg.controller.listen),
                           creds=load_credentials(cfg, region), advertise_url=balancer.advertise_url,
                           grpc_advertise=str(balancer.grpc_advertise))


async def send_heartbeats(address: str, channel: grpc.aio.Channel, *beats: Any) -> None:
    async def outgoing() -> Any:
        for hb in beats:
            yield hb
        await asyncio.sleep(5 * INTERVAL_S)  # keep the stream open while they are applied

    async with channel:
        call = mesh_pb2_grpc.MeshPeerStub(channel).Heartbeat(outgoing())
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(10 * INTERVAL_S):
                async for _ in call:
                    pass


def fake_beat(region: str) -> Any:
    return mesh_pb2.PeerHeartbeat(region=region, balancer_id=f"{region}-forged", epoch=HUGE_EPOCH, seq=1,
                                  replicas_total=1000, replicas_available=1000)


async def test_forged_heartbeats_are_rejected(tmp_path: Path) -> None:
    cfg = identity_config(tmp_path)
    port = free_port()
    # us-east-1 listens; it has two peers and dials none (their ports are closed)
    balancer = tls_balancer(cfg, "us-east-1", port, {"eu-west-1": free_port(), "ap-northeast-1": free_port()})
    use1 = PeerMesh(balancer, balancer)
    addr = f"127.0.0.1:{port}"
    await use1.start()
    try:
        peers = balancer.core.offload.peers
        # no certificate: the handshake fails, nothing is applied
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await send_heartbeats(addr, grpc.aio.insecure_channel(addr), fake_beat("eu-west-1"))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "eu-west-1" not in peers
        # ap-northeast-1's real certificate, claiming to be eu-west-1: dropped and counted;
        # its own heartbeat on the same stream passes the check but is not applied either:
        # only heartbeats answering a stream us-east-1 dialed make a peer available
        ap = creds_of(cfg, "ap-northeast-1")
        server_name = balancer_server_name("us-east-1")
        own = mesh_pb2.PeerHeartbeat(region="ap-northeast-1", balancer_id="aps1", epoch=1, seq=1,
                                     replicas_total=2, replicas_available=1)
        await send_heartbeats(addr, secure_channel(addr, ap, server_name), fake_beat("eu-west-1"), own)
        assert "eu-west-1" not in peers
        assert use1.rejected_heartbeats == {"eu-west-1": 1}
        assert "ap-northeast-1" not in peers
        # the controller's certificate is from the mesh CA but is no peer's: the stream is
        # refused as it opens, before any heartbeat is read. None is sent here: a client
        # still writing when the server's abort arrives gets gRPC's INTERNAL ("Failed
        # execute_batch") instead of the server's status, a race of the client, not of
        # the check (seen once in a full run)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await send_heartbeats(addr, secure_channel(addr, creds_of(cfg, "controller"), server_name))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "eu-west-1" not in peers
        # both refusals are counted for /metrics (skymesh_rejected_peer_calls_total{reason})
        assert rejected_peer_calls([use1]) == {"wrong_region": 1, "not_a_peer": 1}
        # a made-up region name is counted under "other": no caller grows the map
        await send_heartbeats(addr, secure_channel(addr, ap, server_name), fake_beat("mars-1"))
        assert use1.rejected_heartbeats == {"eu-west-1": 1, "other": 1}
    finally:
        await use1.stop()


async def test_a_dialer_only_talks_to_the_region_it_dialed(tmp_path: Path) -> None:
    """us-east-1 dials eu-west-1's address, but ap-northeast-1 answers there: TLS refuses it
    (the certificate does not name eu-west-1), so nothing it says is applied."""
    cfg = identity_config(tmp_path)
    port_use1, port_there = free_port(), free_port()
    balancer = tls_balancer(cfg, "us-east-1", port_use1, {"eu-west-1": port_there})
    use1 = PeerMesh(balancer, balancer)
    there = tls_balancer(cfg, "ap-northeast-1", port_there, {})
    impostor = PeerMesh(there, there)
    await impostor.start()
    await use1.start()
    try:
        await asyncio.sleep(20 * INTERVAL_S)
        assert "eu-west-1" not in balancer.core.offload.peers
        assert "ap-northeast-1" not in balancer.core.offload.peers
    finally:
        await use1.stop()
        await impostor.stop()


async def test_happy_path_two_balancers_and_the_controller(tmp_path: Path) -> None:
    cfg = identity_config(tmp_path)
    port_a, port_b = free_port(), free_port()
    balancer_a = tls_balancer(cfg, "us-east-1", port_a, {"eu-west-1": port_b})
    balancer_b = tls_balancer(cfg, "eu-west-1", port_b, {"us-east-1": port_a})
    a, b = PeerMesh(balancer_a, balancer_a), PeerMesh(balancer_b, balancer_b)
    # the stand-in balancer has no replicas to set: the topology is only recorded
    links = [ControllerLink(x, report_interval_s=INTERVAL_S) for x in (balancer_a, balancer_b)]
    for link, x in zip(links, (balancer_a, balancer_b), strict=True):
        link.report = lambda link=link, x=x: mesh_pb2.BalancerReport(  # type: ignore[method-assign]
            region=x.region, balancer_id=x.balancer_id, epoch=link.controller_epoch, admin_json="{}")
    async with running_controller(cfg) as svc:
        for svc_ in (a, b, *links):
            await svc_.start()
        try:
            async def meshed() -> bool:
                return ("eu-west-1" in balancer_a.core.offload.peers and "us-east-1" in balancer_b.core.offload.peers
                        and all(link.controller_epoch for link in links)
                        and {"us-east-1", "eu-west-1"} <= {name for name, s in svc.regions.items() if s.last_admin is not None})

            await wait_until(meshed, "heartbeats exchanged, both registered and reporting", within_s=20)
            assert a.rejected_heartbeats == {} and b.rejected_heartbeats == {}
            assert svc.regions["us-east-1"].record.balancer_id == "us-east-1-1"
            assert balancer_a.controller_connected and balancer_b.controller_connected
        finally:
            for svc_ in (*links, a, b):
                await svc_.stop()
