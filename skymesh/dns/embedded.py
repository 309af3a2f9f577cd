"""The embedded authoritative DNS server for the mesh name (dnspython + asyncio).

Answers ``<dns.name> A`` with the nearest *healthy* balancer for the client, located by
its EDNS Client Subnet option when present (echoed back with the scope used), else by the
query's source address, matched (longest prefix) against each region's
``source_networks``. Clients matching no region are treated as being in the first region
of the config; an ECS option with source prefix 0 means "do not use my subnet", so the
query's source address decides. With no healthy balancer at all it fails open (answers
the nearest one anyway, as Route53 does) rather than leaving clients with nothing.

Also serves ``<region>.<name> A`` for each region, ``_http._tcp.<name> SRV`` (with the
balancer port), SOA and NS at the apex; NXDOMAIN for other names in the zone, REFUSED
outside it. UDP and TCP (2-byte length framing); over UDP an answer longer than the
client's EDNS buffer (512 bytes without EDNS) is truncated (TC) for a TCP retry.

It runs as its own process so answers keep flowing when the controller is down; the
controller pushes balancer health to a small HTTP control endpoint on
``dns.listen`` host, port + 1, authenticated with the mesh's peer token. That endpoint
also serves ``/metrics`` (``admin.metrics_access``).

A packet that is not a query it can answer is dropped without a reply and without a log
line above DEBUG (a log line per packet would let anyone who can send UDP fill the
disk): shorter than a DNS header (``truncated``), a response (QR bit set: answering
responses is how two servers end up in a loop), or unparseable (``malformed``); each
counted in ``skymesh_dns_dropped_packets_total{reason}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import struct
from dataclasses import asdict
from typing import Any

import aiohttp
import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from skymesh.config import MeshConfig, source_network_of
from skymesh.dns.base import BalancerEndpoint
from skymesh.edge.body import BodyLimits, read_body_or_reject
from skymesh.edge.connection_metrics import EdgeMetrics
from skymesh.edge.openai_errors import error_response
from skymesh.edge.server import EdgeAppRunner, EdgeLimits
from skymesh.security.admin_auth import (
    admin_denied,
    bearer_of,
    metrics_denied,
    peer_token_denied,
    resolve_admin_token,
    resolve_peer_token,
)

log = logging.getLogger("skymesh.dns")
# the endpoint list the controller pushes: a few hundred bytes a region
CONTROL_MAX_BODY_BYTES = 1024 * 1024

HEADER_LEN = 12  # a DNS message header: id, flags, four section counts
QR_BIT = 0x80  # in the first flags byte (byte 2): set on responses
# why a packet got no answer (skymesh_dns_dropped_packets_total's reason label)
DROP_REASONS = ("truncated", "response", "malformed", "error")


class DnsMetrics:
    """The DNS server's own registry (served on the control endpoint's /metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.queries = Counter("skymesh_dns_queries_total", "DNS queries parsed and answered.",
                               registry=self.registry)
        self.dropped = Counter(
            "skymesh_dns_dropped_packets_total",
            "Packets dropped without an answer: truncated (shorter than a DNS header), response "
            "(QR bit set), malformed (does not parse), error (no answer could be built).",
            ("reason",), registry=self.registry)
        self.servfails = Counter("skymesh_dns_servfail_total",
                                 "Queries answered SERVFAIL because building the answer failed.",
                                 registry=self.registry)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)  # every reason on the page from the start, at 0
        # the control API's connection gauge, cap refusals and parser rejections (skymesh/edge/)
        self.edge = EdgeMetrics.create(self.registry)


def control_address(cfg: MeshConfig) -> tuple[str, int]:
    assert cfg.dns.listen is not None
    return cfg.dns.listen.host, cfg.dns.listen.port + 1


class MeshDnsServer:
    def __init__(self, cfg: MeshConfig) -> None:
        self.cfg = cfg
        # name ("dns": UDP and TCP, "control": the HTTP endpoint) -> port bound by start()
        self.bound_ports: dict[str, int] = {}
        self.zone = dns.name.from_text(cfg.dns.name)
        self.ttl = cfg.dns.ttl_s
        self.networks = cfg.source_network_table()
        assert cfg.dns.listen is not None  # the embedded provider's config requires it
        self.peer_token = resolve_peer_token(cfg, (cfg.dns.listen.host,))
        self.endpoints: dict[str, BalancerEndpoint] = {}
        for r in cfg.regions:
            adv = r.balancer.advertise
            self.endpoints[r.name] = BalancerEndpoint(
                region=r.name, balancer_id=r.name, ip=adv.host, port=adv.port, healthy=True,
                aws_region=r.aws_region,
            )
        self.metrics = DnsMetrics()
        self._failures_logged: set[str] = set()  # exception class names already warned about
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._runner: EdgeAppRunner | None = None

    # ------------------------------------------------------------------ answering

    def locate(self, ip: str) -> tuple[str, int]:
        """(region, matched prefix length) of a client address; default: first region."""
        found = source_network_of(self.networks, ip)
        if found is None:
            return self.cfg.regions[0].name, 0
        net, region = found
        return region, net.prefixlen

    def nearest_healthy(self, region: str) -> BalancerEndpoint | None:
        """The client region's balancer if healthy, else the nearest healthy one. With
        none healthy it fails open (like Route53): the nearest balancer regardless."""
        candidates = [e for e in self.endpoints.values() if e.healthy] or list(self.endpoints.values())
        if not candidates:
            return None
        return min(candidates, key=lambda e: (self.cfg.one_way_ms(region, e.region), e.region))

    def _drop(self, reason: str, source_ip: str, error: BaseException | None = None) -> None:
        self.metrics.dropped.labels(reason).inc()
        log.debug("dns packet dropped", extra={"reason": reason, "client": source_ip,
                                               "error": None if error is None else repr(error)})

    def answer(self, wire: bytes, source_ip: str, udp: bool = False) -> bytes | None:
        """The response to one query in wire format; None drops it: a packet shorter than
        a header, a response (QR set), one that does not parse, or one no answer could be
        built for (counted by reason, logged at DEBUG only). Never raises.

        Over UDP an answer longer than the client's EDNS buffer size (512 bytes without
        EDNS, at most 4096) goes back truncated (TC) so the client retries over TCP.
        """
        if len(wire) < HEADER_LEN:
            self._drop("truncated", source_ip)
            return None
        if wire[2] & QR_BIT:
            # a response is never answered, not even with FORMERR (no reply loops)
            self._drop("response", source_ip)
            return None
        try:
            q = dns.message.from_wire(wire)
        except Exception as e:  # noqa: BLE001 - any unparseable packet is dropped, never fatal
            self._drop("malformed", source_ip, e)  # a FORMERR needs a parseable message
            return None
        self.metrics.queries.inc()
        try:
            return self._answer(q, source_ip, udp)
        except Exception as e:  # noqa: BLE001 - one bad query never takes the server down
            self.metrics.servfails.inc()
            # a server bug, not the client's: said once per kind of error, not per packet
            kind = type(e).__name__
            (log.debug if kind in self._failures_logged else log.warning)(
                "dns query failed", extra={"error": repr(e), "client": source_ip})
            self._failures_logged.add(kind)
        try:
            resp = dns.message.make_response(q)
            resp.set_rcode(dns.rcode.SERVFAIL)
            return resp.to_wire()
        except Exception as e:  # noqa: BLE001 - not even a SERVFAIL: drop it
            self._drop("error", source_ip, e)
            return None

    def _answer(self, q: dns.message.Message, source_ip: str, udp: bool) -> bytes:
        out = self._respond(q, source_ip)
        limit = min(4096, max(512, q.payload)) if q.edns >= 0 else 512
        if udp and len(out) > limit:
            tc = dns.message.from_wire(out)
            tc.flags |= dns.flags.TC
            tc.answer.clear()
            tc.authority.clear()
            tc.additional.clear()
            out = tc.to_wire()
        return out

    def _respond(self, q: dns.message.Message, source_ip: str) -> bytes:
        resp = dns.message.make_response(q)
        resp.flags |= dns.flags.AA
        if not q.question:
            resp.set_rcode(dns.rcode.FORMERR)
            return resp.to_wire()
        question = q.question[0]
        qname, qtype = question.name, question.rdtype
        client_ip, ecs = source_ip, None
        for opt in q.options:
            if isinstance(opt, dns.edns.ECSOption):
                ecs = opt
                if opt.srclen > 0:
                    client_ip = opt.address
        region, prefixlen = self.locate(client_ip)
        if ecs is not None and ecs.srclen == 0:
            prefixlen = 0
        if ecs is not None:
            resp.use_edns(0, options=[dns.edns.ECSOption(ecs.address, ecs.srclen, min(prefixlen, ecs.srclen))])
        if not qname.is_subdomain(self.zone):
            resp.set_rcode(dns.rcode.REFUSED)
            resp.flags &= ~dns.flags.AA
            return resp.to_wire()
        records = self._records(qname, qtype, region)
        if records is None:
            resp.set_rcode(dns.rcode.NXDOMAIN)
            resp.authority.append(self._soa())
        elif not records:
            resp.authority.append(self._soa())  # NODATA
        else:
            resp.answer.extend(records)
        return resp.to_wire()

    def _rr(self, name: dns.name.Name, rdtype: int, text: str, ttl: int | None = None) -> dns.rrset.RRset:
        return dns.rrset.from_text(name, self.ttl if ttl is None else ttl, dns.rdataclass.IN, rdtype, text)

    def _soa(self) -> dns.rrset.RRset:
        return self._rr(self.zone, dns.rdatatype.SOA,
                        f"ns1.{self.zone} hostmaster.{self.zone} 1 60 30 86400 {self.ttl}")

    def _records(self, qname: dns.name.Name, qtype: int, region: str) -> list[dns.rrset.RRset] | None:
        by_region = {dns.name.from_text(r, self.zone): r for r in self.endpoints}
        srv_name = dns.name.from_text("_http._tcp", self.zone)
        ns_name = dns.name.from_text("ns1", self.zone)
        if qname == self.zone:
            if qtype in (dns.rdatatype.A, dns.rdatatype.ANY):
                ep = self.nearest_healthy(region)
                return [self._rr(qname, dns.rdatatype.A, ep.ip)] if ep and _is_v4(ep.ip) else []
            if qtype == dns.rdatatype.SOA:
                return [self._soa()]
            if qtype == dns.rdatatype.NS:
                return [self._rr(qname, dns.rdatatype.NS, str(ns_name))]
            return []
        if qname == srv_name:
            if qtype != dns.rdatatype.SRV:
                return []
            ep = self.nearest_healthy(region)
            if ep is None:
                return []
            target = dns.name.from_text(ep.region, self.zone)
            return [self._rr(qname, dns.rdatatype.SRV, f"0 0 {ep.port} {target}")]
        if qname in by_region:
            ep = self.endpoints[by_region[qname]]
            if qtype in (dns.rdatatype.A, dns.rdatatype.ANY) and _is_v4(ep.ip):
                return [self._rr(qname, dns.rdatatype.A, ep.ip)]
            return []
        if qname == ns_name:
            host = self.cfg.dns.listen.host if self.cfg.dns.listen else "127.0.0.1"
            return [self._rr(qname, dns.rdatatype.A, host)] if qtype == dns.rdatatype.A and _is_v4(host) else []
        return None

    # ------------------------------------------------------------------ health updates

    def update(self, endpoints: list[BalancerEndpoint]) -> bool:
        changed = False
        for ep in endpoints:
            if ep.region in self.endpoints and self.endpoints[ep.region] != ep:
                self.endpoints[ep.region] = ep
                changed = True
        if changed:
            log.info("dns endpoints updated",
                     extra={"healthy": sorted(r for r, e in self.endpoints.items() if e.healthy)})
        return changed

    def _control_app(self) -> web.Application:
        # reading the endpoint list needs the admin token; pushing it, the peer token
        app = web.Application()
        admin_token = resolve_admin_token(self.cfg)

        async def metrics(request: web.Request) -> web.Response:
            denied = metrics_denied(request, self.cfg, admin_token)
            if denied is not None:
                return denied
            return web.Response(body=generate_latest(self.metrics.registry),
                                headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

        async def get_endpoints(request: web.Request) -> web.Response:
            denied = admin_denied(request, admin_token, self.cfg.admin.token_env)
            if denied is not None:
                return denied
            return web.json_response([asdict(e) for e in self.endpoints.values()])

        async def put_endpoints(request: web.Request) -> web.Response:
            denied = peer_token_denied(bearer_of(request), self.peer_token)
            if denied is not None:
                return denied
            # the caller is known: its body, within bounds (skymesh/edge/body.py)
            refused = await read_body_or_reject(request, BodyLimits(
                CONTROL_MAX_BODY_BYTES, self.cfg.client_timeouts.body_timeout_s))
            if refused is not None:
                return refused
            try:
                eps = [BalancerEndpoint(**e) for e in await request.json()]
            except (ValueError, TypeError) as e:
                return error_response(400, f"bad endpoint list: {e}", code="invalid_endpoint_list")
            return web.json_response({"changed": self.update(eps)})

        app.router.add_get("/v1/endpoints", get_endpoints)
        app.router.add_put("/v1/endpoints", put_endpoints)
        app.router.add_get("/metrics", metrics)
        return app

    # ------------------------------------------------------------------ serving

    async def start(self) -> None:
        assert self.cfg.dns.listen is not None
        host, port = self.cfg.dns.listen.host, self.cfg.dns.listen.port
        loop = asyncio.get_running_loop()
        server = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport  # type: ignore[assignment]

            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                out = server.answer(data, addr[0], udp=True)  # never raises
                if out is not None:
                    self.transport.sendto(out, addr)  # type: ignore[attr-defined]

            def error_received(self, exc: Exception) -> None:
                # e.g. an ICMP port unreachable for an earlier answer: the client is gone
                log.debug("dns udp error", extra={"error": repr(exc)})

        self._udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=(host, port))
        # with port 0 the kernel picks the UDP port; TCP serves the same number
        port = int(self._udp.get_extra_info("sockname")[1])
        self._tcp = await asyncio.start_server(self._serve_tcp, host, port)
        # bounded heads, connections, idle time and bodies (skymesh/edge/)
        self._runner = EdgeAppRunner(self._control_app(), metrics=self.metrics.edge,
                                     limits=EdgeLimits.from_config(self.cfg))
        await self._runner.setup()
        chost, cport = control_address(self.cfg)
        if self.cfg.dns.listen.port == 0:
            cport = 0  # "DNS port + 1" means nothing for a kernel-picked port: report it instead
        await web.TCPSite(self._runner, chost, cport, reuse_address=True).start()
        self.bound_ports = {"dns": port, "control": int(self._runner.addresses[0][1])}
        log.info("dns server started", extra={"listen": f"{host}:{port}", "zone": str(self.zone)})

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), timeout=10)
                (n,) = struct.unpack("!H", head)
                data = await asyncio.wait_for(reader.readexactly(n), timeout=10)
                out = self.answer(data, peer[0])
                if out is None:
                    break
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()
        if self._runner is not None:
            await self._runner.cleanup()


def _is_v4(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).version == 4
    except ValueError:
        return False


class EmbeddedDnsProvider:
    """DnsProvider for the embedded server: PUTs the health list to its control port."""

    name = "embedded"

    def __init__(self, cfg: MeshConfig) -> None:
        host, port = control_address(cfg)
        self.url = f"http://{host}:{port}/v1/endpoints"
        self.token = resolve_peer_token(cfg, (host,))
        self._session: aiohttp.ClientSession | None = None

    async def sync(self, endpoints: list[BalancerEndpoint]) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        body: list[dict[str, Any]] = [asdict(e) for e in endpoints]
        async with self._session.put(
            self.url, json=body, headers={"Authorization": f"Bearer {self.token}"},
            timeout=aiohttp.ClientTimeout(total=3),
        ) as r:
            r.raise_for_status()
            return bool((await r.json())["changed"])

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
