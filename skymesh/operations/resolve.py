"""`skymesh resolve [NAME] [--config FILE] [--source IP | --subnet CIDR]`: ask the mesh's
embedded DNS server, as a client of a region would, and say which region answered.

The embedded server answers by the client's source network (``source_networks`` of each
region, skymesh/dns/embedded.py): ``--source 127.2.0.5`` sends the query from that address
(on Linux every 127.x.y.z is a loopback address), ``--subnet 10.2.0.0/24`` sends it with
an EDNS Client Subnet option instead (works where only 127.0.0.1 can be bound). Needs no
extra package: dnspython is a dependency. ``--short`` prints only the addresses, like
``dig +short``, for ``curl --resolve NAME:PORT:$(skymesh resolve --short ...)``.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys

import dns.edns
import dns.exception
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype

from skymesh.config import MeshConfig, load_config_for_command, source_network_of

_WILDCARDS = ("0.0.0.0", "::", "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default=None,
                   help="the name to ask for (default: the config's dns.name; a region name asks "
                        "for <region>.<dns.name>)")
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local mesh)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--source", default=None, metavar="IP",
                       help="send the query from this address, e.g. 127.2.0.5 (a client of eu-west-1 "
                            "in the local mesh)")
    where.add_argument("--subnet", default=None, metavar="CIDR",
                       help="send an EDNS Client Subnet option for this network instead, e.g. 10.2.0.0/24")
    p.add_argument("--type", default="A", choices=("A", "SRV", "SOA", "NS"), help="record type (default A)")
    p.add_argument("--short", action="store_true", help="print only the answer's data, one per line")
    p.add_argument("--timeout-s", type=float, default=2.0, help="how long to wait for the answer")


def server_address(cfg: MeshConfig) -> tuple[str, int]:
    """Where the embedded DNS server listens, as a local client reaches it."""
    assert cfg.dns.listen is not None
    host = cfg.dns.listen.host
    return ("127.0.0.1" if host in _WILDCARDS else host), cfg.dns.listen.port


def query_name(cfg: MeshConfig, name: str | None) -> str:
    if name is None:
        return cfg.dns.name
    if name in {r.name for r in cfg.regions}:
        return f"{name}.{cfg.dns.name}"
    return name


def local_source(server: tuple[str, int]) -> str:
    """The address this machine sends from to reach ``server`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(server)
        return str(s.getsockname()[0])


def ask(cfg: MeshConfig, name: str, rdtype: str, source: str | None, subnet: str | None,
        timeout_s: float) -> dns.message.Message:
    """One query to the embedded server (UDP, TCP when the answer is truncated)."""
    q = dns.message.make_query(name, rdtype)
    if subnet is not None:
        net = ipaddress.ip_network(subnet, strict=False)
        q.use_edns(0, options=[dns.edns.ECSOption(str(net.network_address), net.prefixlen)])
    host, port = server_address(cfg)
    answer, _ = dns.query.udp_with_fallback(q, host, timeout=timeout_s, port=port, source=source)
    return answer


def client_region(cfg: MeshConfig, source: str, subnet: str | None) -> tuple[str, str]:
    """(region, why) the server takes the client to be in: the region of its source
    network (or ECS subnet); no region's network: the config's first region."""
    probe = str(ipaddress.ip_network(subnet, strict=False).network_address) if subnet else source
    found = source_network_of(cfg.source_network_table(), probe)
    if found is None:
        return cfg.regions[0].name, "in no region's source_networks: the config's first region"
    net, region = found
    return region, f"source network {net}"


def answer_lines(cfg: MeshConfig, answer: dns.message.Message, client: str) -> list[str]:
    """Each record of the answer, an A record with the region whose balancer it is (and a
    word when that is not the client's own region: its balancer is down or draining)."""
    by_host: dict[str, list[str]] = {}
    for r in cfg.regions:
        by_host.setdefault(r.balancer.advertise.host, []).append(r.name)
    lines = []
    for rrset in answer.answer:
        for rr in rrset:
            line = f"{rrset.name} {rrset.ttl} IN {dns.rdatatype.to_text(rrset.rdtype)} {rr.to_text()}"
            if rrset.rdtype == dns.rdatatype.A and rr.address in by_host:
                regions = by_host[rr.address]
                urls = {cfg.region(n).balancer.advertise_url for n in regions}
                line += f"   -> the balancer of {' or '.join(regions)} ({', '.join(sorted(urls))})"
                if client not in regions:
                    line += f"; the nearest healthy one to {client}"
            lines.append(line)
    return lines


def run(args: argparse.Namespace) -> int:
    cfg = load_config_for_command(args.config)
    if cfg is None:
        return 2
    if cfg.dns.provider != "embedded" or cfg.dns.listen is None:
        print(f"skymesh resolve: this config's DNS is {cfg.dns.provider} (no embedded server to ask); "
              f"ask a resolver for {cfg.dns.name}", file=sys.stderr)
        return 2
    if args.subnet is not None:
        try:
            ipaddress.ip_network(args.subnet, strict=False)
        except ValueError as e:
            print(f"skymesh resolve: --subnet: {e}", file=sys.stderr)
            return 2
    server = server_address(cfg)
    name = query_name(cfg, args.name)
    try:
        source = args.source or local_source(server)
        answer = ask(cfg, name, args.type, args.source, args.subnet, args.timeout_s)
    except dns.exception.Timeout:
        print(f"skymesh resolve: no answer from the DNS server at {server[0]}:{server[1]} within "
              f"{args.timeout_s:g}s (is the mesh up? `make run`)", file=sys.stderr)
        return 1
    except OSError as e:
        hint = " (an address of this machine; --subnet CIDR asks for a network without binding it)" \
            if args.source else " (is the mesh up? `make run`)"
        print(f"skymesh resolve: cannot ask {server[0]}:{server[1]}"
              f"{f' from {args.source}' if args.source else ''}: {e.strerror or e}{hint}", file=sys.stderr)
        return 1
    region, why = client_region(cfg, source, args.subnet)
    lines = answer_lines(cfg, answer, region)
    if args.short:
        for rrset in answer.answer:
            for rr in rrset:
                print(rr.to_text())
    else:
        print(f";; asked {server[0]}:{server[1]} for {name} {args.type}: {dns.rcode.to_text(answer.rcode())}")
        print(f";; client {args.subnet or source}: a client of {region} ({why})")
        print("\n".join(lines) if lines else f";; no {args.type} record")
    return 0 if answer.rcode() == dns.rcode.NOERROR and lines else 1
