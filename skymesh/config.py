"""Typed mesh configuration loaded from YAML.

Every validation error names the exact path of the offending value
(``regions[1].replicas[0].url: expected an http(s) URL, got 'ftp://x'``) so an operator
can fix a config without reading this code. Unknown keys are errors: a typo must never
silently fall back to a default.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

REGION_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{1,62}$")
REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DNS_NAME_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z][a-z0-9-]{0,61}[a-z0-9]\.?$")
KNOWN_POLICIES = (
    "dualmap",
    "prefix_tree",
    "consistent_hash",
    "round_robin",
    "least_load",
    "cache_aware",
    "min_ttft",
    "preble",
)


class ConfigError(ValueError):
    """A config value is wrong; ``path`` says exactly where."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class SimReplica:
    """A vLLM stand-in started by ``skymesh up`` on ``port``."""

    profile: str
    port: int
    time_scale: float = 1.0
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class ReplicaConfig:
    id: str
    url: str  # base URL of the OpenAI-compatible server (for sim replicas: derived)
    sim: SimReplica | None = None


@dataclass(frozen=True)
class BalancerConfig:
    listen: HostPort  # HTTP (OpenAI API, admin, metrics)
    grpc_listen: HostPort  # balancer<->balancer heartbeats
    # what clients, peers and DNS use. With emulate_latency, `skymesh up` puts a delay
    # proxy on these addresses in front of `listen` / `grpc_listen`.
    advertise: HostPort
    grpc_advertise: HostPort
    # the address DNS publishes for clients (a public IP in the cloud); None: advertise host
    public_ip: str | None = None

    @property
    def advertise_url(self) -> str:
        return self.advertise.http_url


@dataclass(frozen=True)
class RegionConfig:
    name: str
    source_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    balancer: BalancerConfig
    replicas: tuple[ReplicaConfig, ...]
    aws_region: str | None = None
    # source address this region's balancer binds when it connects to peers, so a delay
    # proxy (or a real network) can tell which region traffic comes from
    egress_source: str | None = None


@dataclass(frozen=True)
class OffloadRule:
    source: str  # glob over region names, e.g. "eu-*"
    allowed_targets: tuple[str, ...]  # globs

    def matches_source(self, region: str) -> bool:
        return fnmatch.fnmatchcase(region, self.source)

    def allows(self, target: str) -> bool:
        return any(fnmatch.fnmatchcase(target, g) for g in self.allowed_targets)


@dataclass(frozen=True)
class OffloadConfig:
    enabled: bool = True
    # tau: a remote region with more requests queued at its balancer is not a target.
    max_remote_queue: int = 4
    heartbeat_interval_s: float = 0.1
    # a peer missing this many heartbeat intervals is unavailable
    heartbeat_miss_limit: int = 3
    rules: tuple[OffloadRule, ...] = ()

    def allowed(self, source: str, target: str) -> bool:
        """First rule whose source glob matches decides; no matching rule allows all."""
        for rule in self.rules:
            if rule.matches_source(source):
                return rule.allows(target)
        return True


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "dualmap"
    ttft_slo_s: float = 2.0
    probe_interval_s: float = 0.1
    queue_bound: int = 1024
    # prompt chunking for prefix hashing, in tokens of the documented tokenizer contract
    chunk_tokens: int = 64
    # bound on prefix-trie nodes per balancer (memory stays bounded)
    trie_max_nodes: int = 200_000
    max_body_bytes: int = 4 * 1024 * 1024
    max_retries: int = 2
    options: dict[str, Any] = field(default_factory=dict)  # policy-specific knobs


@dataclass(frozen=True)
class ControllerConfig:
    listen: HostPort  # gRPC
    http_listen: HostPort  # JSON status for `skymesh status`
    state_path: str = ".skymesh/controller.sqlite"
    probe_interval_s: float = 1.0
    failure_threshold: int = 3


@dataclass(frozen=True)
class DnsConfig:
    name: str
    provider: str = "embedded"  # embedded | route53
    listen: HostPort | None = None  # embedded server address
    ttl_s: int = 5
    hosted_zone: str | None = None  # route53
    # route53 API endpoint override (an emulator on loopback in tests); None: AWS
    endpoint_url: str | None = None
    # route53 routing: "latency" (every region, nearest healthy answers) or "failover"
    # (exactly two regions: PRIMARY = first alive in config order, SECONDARY the other)
    routing: str = "latency"


@dataclass(frozen=True)
class MeshConfig:
    model: str
    regions: tuple[RegionConfig, ...]
    # one-way latency in ms, symmetric, for every pair of distinct regions
    latency_ms: dict[tuple[str, str], float]
    # one-way latency from a client to the balancer of its own region
    local_latency_ms: float
    controller: ControllerConfig
    dns: DnsConfig
    policy: PolicyConfig
    offload: OffloadConfig
    peer_token: str
    emulate_latency: bool = True

    def region(self, name: str) -> RegionConfig:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def one_way_ms(self, a: str, b: str) -> float:
        if a == b:
            return self.local_latency_ms
        return self.latency_ms[(a, b) if a < b else (b, a)]

    def rtt_ms(self, a: str, b: str) -> float:
        return 2 * self.one_way_ms(a, b)


# ----------------------------------------------------------------------------- parsing


class _Obj:
    """A YAML mapping being read at ``path``; reports unknown keys when done."""

    def __init__(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise ConfigError(path or "<root>", f"expected a mapping, got {_kind(value)}")
        self.value = value
        self.path = path
        self.seen: set[str] = set()

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, default: Any = ..., required: bool = False) -> Any:
        self.seen.add(key)
        if key in self.value:
            return self.value[key]
        if required or default is ...:
            raise ConfigError(self.sub(key), "is required")
        return default

    def done(self) -> None:
        unknown = sorted(set(map(str, self.value)) - self.seen)
        if unknown:
            raise ConfigError(
                self.sub(unknown[0]),
                f"unknown key (allowed: {', '.join(sorted(self.seen))})",
            )


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), type(v).__name__
    )


def _str(v: Any, path: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(path, f"expected a non-empty string, got {_kind(v)}")
    if pattern is not None and not pattern.match(v):
        raise ConfigError(path, f"expected {what}, got {v!r}")
    return v


def _num(v: Any, path: str, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(path, f"expected a number, got {_kind(v)}")
    if lo is not None and v < lo:
        raise ConfigError(path, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ConfigError(path, f"must be <= {hi}, got {v}")
    return float(v)


def _int(v: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(path, f"expected an integer, got {_kind(v)}")
    _num(v, path, lo, hi)
    return v


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(path, f"expected true or false, got {_kind(v)}")
    return v


def _list(v: Any, path: str, nonempty: bool = True) -> list[Any]:
    if not isinstance(v, list):
        raise ConfigError(path, f"expected a list, got {_kind(v)}")
    if nonempty and not v:
        raise ConfigError(path, "must not be empty")
    return v


def _hostport(v: Any, path: str) -> HostPort:
    s = _str(v, path)
    host, sep, port = s.rpartition(":")
    if not sep or not host:
        raise ConfigError(path, f"expected host:port, got {s!r}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(path, f"expected a port 1-65535, got {port!r}")
    return HostPort(host.strip("[]"), int(port))


def _url(v: Any, path: str) -> str:
    s = _str(v, path)
    u = urlparse(s)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError(path, f"expected an http(s) URL like http://10.0.0.5:8000, got {s!r}")
    try:
        u.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(path, f"bad port in URL {s!r}") from None
    return s.rstrip("/")


def _parse_replica(v: Any, path: str, profiles: set[str]) -> ReplicaConfig:
    o = _Obj(v, path)
    rid = _str(o.get("id"), o.sub("id"), REPLICA_ID_RE, "letters, digits, '.', '_' or '-'")
    url_v = o.get("url", None)
    sim_v = o.get("sim", None)
    if (url_v is None) == (sim_v is None):
        raise ConfigError(path, "exactly one of 'url' (a real vLLM server) or 'sim' is required")
    sim = None
    if sim_v is not None:
        so = _Obj(sim_v, o.sub("sim"))
        profile = _str(so.get("profile"), so.sub("profile"))
        if profiles and profile not in profiles:
            raise ConfigError(
                so.sub("profile"), f"unknown profile {profile!r} (known: {', '.join(sorted(profiles))})"
            )
        port = _int(so.get("port"), so.sub("port"), 1, 65535)
        ts = _num(so.get("time_scale", 1.0), so.sub("time_scale"), 0.001, 1000.0)
        host = _str(so.get("host", "127.0.0.1"), so.sub("host"))
        so.done()
        sim = SimReplica(profile=profile, port=port, time_scale=ts, host=host)
        url = f"http://{host}:{port}"
    else:
        url = _url(url_v, o.sub("url"))
    o.done()
    return ReplicaConfig(id=rid, url=url, sim=sim)


def _parse_region(v: Any, path: str, profiles: set[str]) -> RegionConfig:
    o = _Obj(v, path)
    name = _str(o.get("name"), o.sub("name"), REGION_NAME_RE, "a lowercase region name like eu-west-1")
    nets = []
    for i, n in enumerate(_list(o.get("source_networks"), o.sub("source_networks"))):
        p = f"{o.sub('source_networks')}[{i}]"
        try:
            nets.append(ipaddress.ip_network(_str(n, p), strict=True))
        except ValueError as e:
            raise ConfigError(p, f"expected a CIDR network like 10.1.0.0/16 ({e})") from None
    bo = _Obj(o.get("balancer"), o.sub("balancer"))
    listen = _hostport(bo.get("listen"), bo.sub("listen"))
    grpc_listen = _hostport(bo.get("grpc_listen"), bo.sub("grpc_listen"))
    adv = bo.get("advertise", None)
    advertise = listen if adv is None else _hostport(adv, bo.sub("advertise"))
    gadv = bo.get("grpc_advertise", None)
    grpc_advertise = grpc_listen if gadv is None else _hostport(gadv, bo.sub("grpc_advertise"))
    pip = bo.get("public_ip", None)
    public_ip = None
    if pip is not None:
        try:
            public_ip = str(ipaddress.ip_address(_str(pip, bo.sub("public_ip"))))
        except ValueError:
            raise ConfigError(bo.sub("public_ip"), f"expected an IP address, got {pip!r}") from None
    bo.done()
    replicas = []
    seen: dict[str, int] = {}
    for i, r in enumerate(_list(o.get("replicas"), o.sub("replicas"))):
        rep = _parse_replica(r, f"{o.sub('replicas')}[{i}]", profiles)
        if rep.id in seen:
            raise ConfigError(
                f"{o.sub('replicas')}[{i}].id", f"duplicate replica id {rep.id!r} (also at index {seen[rep.id]})"
            )
        seen[rep.id] = i
        replicas.append(rep)
    eg = o.get("egress_source", None)
    egress = None
    if eg is not None:
        try:
            egress = str(ipaddress.ip_address(_str(eg, o.sub("egress_source"))))
        except ValueError:
            raise ConfigError(o.sub("egress_source"), f"expected an IP address, got {eg!r}") from None
        if not any(ipaddress.ip_address(egress) in n for n in nets):
            raise ConfigError(o.sub("egress_source"), f"{egress} is not inside this region's source_networks")
    aws = o.get("aws_region", None)
    aws_region = None if aws is None else _str(aws, o.sub("aws_region"), REGION_NAME_RE, "an AWS region")
    o.done()
    return RegionConfig(
        name=name,
        source_networks=tuple(nets),
        balancer=BalancerConfig(
            listen=listen, grpc_listen=grpc_listen, advertise=advertise, grpc_advertise=grpc_advertise,
            public_ip=public_ip,
        ),
        replicas=tuple(replicas),
        aws_region=aws_region,
        egress_source=egress,
    )


def _parse_policy(v: Any, path: str) -> PolicyConfig:
    o = _Obj(v, path)
    name = _str(o.get("name", "dualmap"), o.sub("name"))
    if name not in KNOWN_POLICIES:
        raise ConfigError(o.sub("name"), f"unknown policy {name!r} (known: {', '.join(KNOWN_POLICIES)})")
    opts = o.get("options", {})
    if not isinstance(opts, dict):
        raise ConfigError(o.sub("options"), f"expected a mapping, got {_kind(opts)}")
    pc = PolicyConfig(
        name=name,
        ttft_slo_s=_num(o.get("ttft_slo_s", 2.0), o.sub("ttft_slo_s"), 0.001),
        probe_interval_s=_num(o.get("probe_interval_s", 0.1), o.sub("probe_interval_s"), 0.005, 60),
        queue_bound=_int(o.get("queue_bound", 1024), o.sub("queue_bound"), 1),
        chunk_tokens=_int(o.get("chunk_tokens", 64), o.sub("chunk_tokens"), 1, 1 << 20),
        trie_max_nodes=_int(o.get("trie_max_nodes", 200_000), o.sub("trie_max_nodes"), 16),
        max_body_bytes=_int(o.get("max_body_bytes", 4 << 20), o.sub("max_body_bytes"), 1024),
        max_retries=_int(o.get("max_retries", 2), o.sub("max_retries"), 0, 16),
        options=dict(opts),
    )
    o.done()
    return pc


def _parse_offload(v: Any, path: str, region_names: list[str]) -> OffloadConfig:
    o = _Obj(v, path)
    rules = []
    for i, r in enumerate(_list(o.get("rules", []), o.sub("rules"), nonempty=False)):
        rp = f"{o.sub('rules')}[{i}]"
        ro = _Obj(r, rp)
        src = _str(ro.get("from"), f"{rp}.from")
        if not any(fnmatch.fnmatchcase(n, src) for n in region_names):
            raise ConfigError(f"{rp}.from", f"pattern {src!r} matches no configured region")
        targets = tuple(
            _str(t, f"{rp}.to[{j}]") for j, t in enumerate(_list(ro.get("to"), f"{rp}.to", nonempty=False))
        )
        ro.done()
        rules.append(OffloadRule(source=src, allowed_targets=targets))
    oc = OffloadConfig(
        enabled=_bool(o.get("enabled", True), o.sub("enabled")),
        max_remote_queue=_int(o.get("max_remote_queue", 4), o.sub("max_remote_queue"), 0),
        heartbeat_interval_s=_num(o.get("heartbeat_interval_s", 0.1), o.sub("heartbeat_interval_s"), 0.01, 60),
        heartbeat_miss_limit=_int(o.get("heartbeat_miss_limit", 3), o.sub("heartbeat_miss_limit"), 1, 100),
        rules=tuple(rules),
    )
    o.done()
    return oc


def parse_config(data: Any, profiles: set[str] | None = None) -> MeshConfig:
    """Validate a parsed YAML document into a :class:`MeshConfig`."""
    if profiles is None:
        from skymesh.replica_sim.profiles import PROFILES

        profiles = set(PROFILES)
    o = _Obj(data, "")
    model = _str(o.get("model", "skymesh-sim"), "model")
    regions: list[RegionConfig] = []
    names: dict[str, int] = {}
    for i, r in enumerate(_list(o.get("regions"), "regions")):
        reg = _parse_region(r, f"regions[{i}]", profiles)
        if reg.name in names:
            raise ConfigError(f"regions[{i}].name", f"duplicate region {reg.name!r} (also regions[{names[reg.name]}])")
        names[reg.name] = i
        regions.append(reg)
    _check_unique_endpoints(regions)

    lat: dict[tuple[str, str], float] = {}
    for i, e in enumerate(_list(o.get("latencies", []), "latencies", nonempty=False)):
        p = f"latencies[{i}]"
        eo = _Obj(e, p)
        pair = _list(eo.get("regions"), f"{p}.regions")
        if len(pair) != 2:
            raise ConfigError(f"{p}.regions", f"expected two region names, got {len(pair)}")
        a, b = (_str(x, f"{p}.regions[{j}]") for j, x in enumerate(pair))
        for j, n in enumerate((a, b)):
            if n not in names:
                raise ConfigError(f"{p}.regions[{j}]", f"unknown region {n!r}")
        if a == b:
            raise ConfigError(f"{p}.regions", "a latency needs two different regions")
        key = (a, b) if a < b else (b, a)
        if key in lat:
            raise ConfigError(f"{p}.regions", f"latency between {a} and {b} given twice")
        lat[key] = _num(eo.get("one_way_ms"), f"{p}.one_way_ms", 0, 10_000)
        eo.done()
    for i, ra in enumerate(regions):
        for rb in regions[i + 1 :]:
            key = (ra.name, rb.name) if ra.name < rb.name else (rb.name, ra.name)
            if key not in lat:
                raise ConfigError("latencies", f"missing one-way latency between {key[0]} and {key[1]}")
    local_ms = _num(o.get("local_latency_ms", 1.0), "local_latency_ms", 0, 1000)

    co = _Obj(o.get("controller"), "controller")
    controller = ControllerConfig(
        listen=_hostport(co.get("listen"), "controller.listen"),
        http_listen=_hostport(co.get("http_listen"), "controller.http_listen"),
        state_path=_str(co.get("state_path", ".skymesh/controller.sqlite"), "controller.state_path"),
        probe_interval_s=_num(co.get("probe_interval_s", 1.0), "controller.probe_interval_s", 0.05, 600),
        failure_threshold=_int(co.get("failure_threshold", 3), "controller.failure_threshold", 1, 100),
    )
    co.done()

    do = _Obj(o.get("dns"), "dns")
    dname = _str(do.get("name"), "dns.name", DNS_NAME_RE, "a DNS name like llm.example.com")
    provider = _str(do.get("provider", "embedded"), "dns.provider")
    if provider not in ("embedded", "route53"):
        raise ConfigError("dns.provider", f"expected 'embedded' or 'route53', got {provider!r}")
    listen_v = do.get("listen", None)
    dlisten = None if listen_v is None else _hostport(listen_v, "dns.listen")
    if provider == "embedded" and dlisten is None:
        raise ConfigError("dns.listen", "is required for the embedded DNS server")
    zone_v = do.get("hosted_zone", None)
    zone = None if zone_v is None else _str(zone_v, "dns.hosted_zone")
    if provider == "route53" and zone is None:
        raise ConfigError("dns.hosted_zone", "is required for provider route53")
    ep_v = do.get("endpoint_url", None)
    endpoint_url = None if ep_v is None else _url(ep_v, "dns.endpoint_url")
    routing = _str(do.get("routing", "latency"), "dns.routing")
    if routing not in ("latency", "failover"):
        raise ConfigError("dns.routing", f"expected 'latency' or 'failover', got {routing!r}")
    if routing == "failover" and provider != "route53":
        raise ConfigError("dns.routing", "failover routing is a Route53 record type; use provider route53")
    if routing == "failover" and len(regions) != 2:
        raise ConfigError("dns.routing", f"failover routing needs exactly 2 regions, the config has {len(regions)}")
    dns = DnsConfig(
        name=dname.rstrip("."),
        provider=provider,
        listen=dlisten,
        ttl_s=_int(do.get("ttl_s", 5), "dns.ttl_s", 1, 86400),
        hosted_zone=zone,
        endpoint_url=endpoint_url,
        routing=routing,
    )
    do.done()

    policy = _parse_policy(o.get("policy", {}), "policy")
    offload = _parse_offload(o.get("offload", {}), "offload", list(names))
    token = _str(o.get("peer_token", "skymesh-local-peer-token"), "peer_token")
    emulate = _bool(o.get("emulate_latency", True), "emulate_latency")
    o.done()
    return MeshConfig(
        model=model,
        regions=tuple(regions),
        latency_ms=lat,
        local_latency_ms=local_ms,
        controller=controller,
        dns=dns,
        policy=policy,
        offload=offload,
        peer_token=token,
        emulate_latency=emulate,
    )


def _check_unique_endpoints(regions: list[RegionConfig]) -> None:
    used: dict[tuple[str, int], str] = {}

    def claim(hp: tuple[str, int], path: str) -> None:
        # only loopback addresses are known to share one machine (the local mesh);
        # 0.0.0.0:8000 on two different cloud hosts is fine
        if not hp[0].startswith("127.") and hp[0] != "localhost":
            return
        if hp in used:
            raise ConfigError(path, f"address {hp[0]}:{hp[1]} is already used by {used[hp]}")
        used[hp] = path

    for i, r in enumerate(regions):
        claim((r.balancer.listen.host, r.balancer.listen.port), f"regions[{i}].balancer.listen")
        claim((r.balancer.grpc_listen.host, r.balancer.grpc_listen.port), f"regions[{i}].balancer.grpc_listen")
        if r.balancer.advertise != r.balancer.listen:
            claim((r.balancer.advertise.host, r.balancer.advertise.port), f"regions[{i}].balancer.advertise")
        if r.balancer.grpc_advertise != r.balancer.grpc_listen:
            claim(
                (r.balancer.grpc_advertise.host, r.balancer.grpc_advertise.port),
                f"regions[{i}].balancer.grpc_advertise",
            )
        for j, rep in enumerate(r.replicas):
            if rep.sim is not None:
                claim((rep.sim.host, rep.sim.port), f"regions[{i}].replicas[{j}].sim.port")


def load_config(path: str | Path | None = None) -> MeshConfig:
    """Load a YAML file; ``None`` loads the embedded local 3-region default."""
    if path is None:
        text = resources.files("skymesh").joinpath("local.yaml").read_text()
        src = "<embedded local.yaml>"
    else:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError("", f"cannot read config {p}: {e.strerror}") from None
        src = str(p)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{src} is not valid YAML: {e}") from None
    return parse_config(data)
