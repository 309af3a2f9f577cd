"""Typed mesh configuration loaded from YAML, validated by pydantic models.

Every validation error names the exact path of the offending value
(``regions[1].replicas[0].url: expected an http(s) URL, got 'ftp://x'``) so an operator
can fix a config without reading this code. Unknown keys are errors: a typo must never
silently fall back to a default. Config objects are frozen. ``config_schema()`` (``skymesh
config --schema``) is the JSON schema of the YAML format, for editors and CI linting.

Scalars are strict (a YAML ``"yes"`` is not a boolean, ``2.0`` is not an integer):
YAML already types them. Values the models derive (a sim replica's URL, an advertise
address defaulting to the listen address) are filled in by the models' validators.
"""

from __future__ import annotations

import fnmatch
import hashlib
import ipaddress
import json
import re
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    SerializeAsAny,
    Strict,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from skymesh.routing.disciplines.base import DEFAULT_MAX_AGE_S
from skymesh.routing.disciplines.prefix_match import DEFAULT_PREFIX_TTFT_SHARE
from skymesh.routing.disciplines.slo_deadline import DEFAULT_ITERATIONS, DEFAULT_WINDOW
from skymesh.routing.options import PolicyOptions
from skymesh.routing.queue_registry import DisciplineName
from skymesh.routing.registry import POLICIES, policy_options
from skymesh.source_networks import (  # the lookup's callers import it from here too
    SourceNetworkTable,
    region_of_address,  # noqa: F401
    source_network_of,  # noqa: F401
)
from skymesh.validation import PathError, first_error, kind

REGION_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{1,62}$")
REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DNS_NAME_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z][a-z0-9-]{0,61}[a-z0-9]\.?$")


class ConfigError(PathError):
    """A config value is wrong; ``path`` says exactly where (``regions[0].name``).

    Validators raise it with a path relative to what they validate; :func:`parse_config`
    raises it with the full path.
    """


def _first_repeat(values: Iterable[Hashable]) -> tuple[int, int] | None:
    """(index, index of its first occurrence) of the first value seen twice, or None."""
    seen: dict[Hashable, int] = {}
    for i, value in enumerate(values):
        if value in seen:
            return i, seen[value]
        seen[value] = i
    return None


# ----------------------------------------------------------------------------- value types


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _nonempty_str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError("", f"expected a non-empty string, got {kind(value)}")
    return value


def _parse_hostport(value: Any) -> HostPort:
    if isinstance(value, HostPort):
        return value
    text = _nonempty_str(value)
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ConfigError("", f"expected host:port, got {text!r}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError("", f"expected a port 1-65535, got {port!r}")
    return HostPort(host.strip("[]"), int(port))


def _parse_url(value: Any) -> str:
    text = _nonempty_str(value)
    url = urlparse(text)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError("", f"expected an http(s) URL like http://10.0.0.5:8000, got {text!r}")
    try:
        url.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError("", f"bad port in URL {text!r}") from None
    return text.rstrip("/")


def _parse_network(value: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(_nonempty_str(value), strict=True)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError("", f"expected a CIDR network like 10.1.0.0/16 ({e})") from None


def _parse_ip(value: Any) -> str:
    try:
        return str(ipaddress.ip_address(_nonempty_str(value)))
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError("", f"expected an IP address, got {value!r}") from None


def _or_null(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    # for fields whose default another field derives: an explicit YAML null means "default"
    return lambda value: None if value is None else parse(value)


def _matching(pattern: re.Pattern[str], what: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if not pattern.match(value):
            raise ConfigError("", f"expected {what}, got {value!r}")
        return value

    return check


def _string_type(parse: Callable[[Any], Any], description: str, **schema: Any) -> Any:
    """A config value written as one string and parsed by ``parse`` (which raises
    ConfigError with the operator's wording); the JSON schema says it is a string."""
    return (
        PlainValidator(parse),
        PlainSerializer(str, return_type=str),
        WithJsonSchema({"type": "string", "description": description, **schema}),
    )


Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # a YAML integer is a number too
Bool = Annotated[bool, Strict()]
Text = Annotated[str, Strict(), Field(min_length=1)]
Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
HostPortField = Annotated[HostPort, *_string_type(_parse_hostport, "host:port", examples=["127.0.0.1:8000"])]
HttpUrlStr = Annotated[str, *_string_type(_parse_url, "http(s) URL", examples=["http://10.0.0.5:8000"])]
# a value a validator derives when it is absent or null (its field's default is None)
DerivedHostPort = Annotated[
    HostPort, *_string_type(_or_null(_parse_hostport), "host:port", examples=["127.0.0.1:8000"])
]
DerivedHttpUrl = Annotated[
    str, *_string_type(_or_null(_parse_url), "http(s) URL", examples=["http://10.0.0.5:8000"])
]
Network = Annotated[
    ipaddress.IPv4Network | ipaddress.IPv6Network,
    *_string_type(_parse_network, "CIDR network", examples=["10.1.0.0/16"]),
]
IpAddress = Annotated[str, *_string_type(_parse_ip, "IP address")]
RegionName = Annotated[
    Text,
    AfterValidator(_matching(REGION_NAME_RE, "a lowercase region name like eu-west-1")),
    Field(json_schema_extra={"pattern": REGION_NAME_RE.pattern}),
]
AwsRegion = Annotated[
    Text, AfterValidator(_matching(REGION_NAME_RE, "an AWS region")),
    Field(json_schema_extra={"pattern": REGION_NAME_RE.pattern}),
]
ReplicaId = Annotated[
    Text,
    AfterValidator(_matching(REPLICA_ID_RE, "letters, digits, '.', '_' or '-'")),
    Field(json_schema_extra={"pattern": REPLICA_ID_RE.pattern}),
]
DnsName = Annotated[
    Text,
    AfterValidator(_matching(DNS_NAME_RE, "a DNS name like llm.example.com")),
    AfterValidator(lambda name: name.rstrip(".")),
    Field(json_schema_extra={"pattern": DNS_NAME_RE.pattern}),
]


def _derive(model: BaseModel, field: str, value: Any) -> None:
    # models are frozen; a validator filling in a derived default is the one writer
    object.__setattr__(model, field, value)


# ----------------------------------------------------------------------------- models


class ConfigModel(BaseModel):
    """Base of every config model: frozen, unknown keys rejected with the allowed ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_keys(cls, data: Any) -> Any:
        # extra="forbid" would reject them too; this names the keys that are allowed
        if isinstance(data, Mapping):
            allowed = {f.alias or name for name, f in cls.model_fields.items()}
            unknown = sorted(str(k) for k in data if k not in allowed)
            if unknown:
                raise ConfigError(unknown[0], f"unknown key (allowed: {', '.join(sorted(allowed))})")
        return data


class SimKvEvents(ConfigModel):
    """The stand-in publishes vLLM 0.32's KV events (``replica-sim --kv-events-config``):
    its PUB socket on ``port`` and its replay ROUTER socket on ``replay_port`` of
    ``sim.host`` (started with vLLM's ``"endpoint": "tcp://*:PORT"``, which the stand-in
    binds on its ``--host``)."""

    port: Port
    replay_port: Port | None = None
    topic: Annotated[str, Strict()] = ""
    # batches the replay socket keeps
    buffer_steps: Annotated[Int, Field(ge=1)] = 10_000

    def vllm_json(self) -> str:
        """The ``--kv-events-config`` the stand-in is started with."""
        replay = None if self.replay_port is None else f"tcp://*:{self.replay_port}"
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.port}",
                           "replay_endpoint": replay, "topic": self.topic, "buffer_steps": self.buffer_steps},
                          separators=(",", ":"))


class SimReplica(ConfigModel):
    """A vLLM stand-in started by ``skymesh up`` on ``port``."""

    profile: Text
    port: Port
    time_scale: Annotated[Float, Field(ge=0.001, le=1000.0)] = 1.0
    host: Text = "127.0.0.1"
    # the model's local HF tokenizer.json: the stand-in's token ids (prefix caching, KV
    # events) are then the tokenizer's; without it, whitespace words
    tokenizer: Text | None = None
    # publish vLLM's KV events; the replica's kv_events (what the balancer subscribes to)
    # follow from it
    kv_events: SimKvEvents | None = None
    # vLLM's --enable-prompt-tokens-details: answers' usage reports the cached prompt
    # tokens, which the balancer compares with its policy's prediction
    enable_prompt_tokens_details: bool = False

    @model_validator(mode="after")
    def _distinct_ports(self) -> SimReplica:
        kv = self.kv_events
        if kv is not None:
            if kv.port == self.port:
                raise ConfigError("kv_events.port", f"port {kv.port} is the replica's HTTP port too")
            if kv.replay_port is not None and kv.replay_port in (self.port, kv.port):
                raise ConfigError("kv_events.replay_port", f"port {kv.replay_port} is taken by the replica already")
        return self

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, profile: str, info: ValidationInfo) -> str:
        context = info.context or {}
        if "profiles" in context:
            profiles = set(context["profiles"])
        else:
            from skymesh.hardware import PROFILES

            profiles = set(PROFILES)
        if profiles and profile not in profiles:
            raise ConfigError("", f"unknown profile {profile!r} (known: {', '.join(sorted(profiles))})")
        return profile


class KvEventsEndpoint(ConfigModel):
    """Where a replica publishes vLLM's KV events (its ``--kv-events-config``): the
    balancer subscribes and keeps the replica's exact cache state (skymesh/routing/kv_index.py)."""

    # the replica's ZMQ PUB socket, e.g. tcp://10.0.0.5:5557
    endpoint: Annotated[Text, Field(pattern=r"^tcp://[^\s/]+:\d{1,5}$")]
    # its replay ROUTER socket (missed batches by sequence number); None: gaps stay gaps
    replay_endpoint: Annotated[Text, Field(pattern=r"^tcp://[^\s/]+:\d{1,5}$")] | None = None
    topic: str = ""
    # the index's bound in blocks (the replica's KV capacity, vllm:cache_config_info's
    # num_gpu_blocks); past it the least recently stored blocks are dropped
    max_blocks: Annotated[Int, Field(ge=1, le=1 << 24)] = 200_000


def _sim_kv_events(sim: SimReplica) -> KvEventsEndpoint:
    """Where a balancer subscribes to a publishing stand-in; the index bound is its KV
    capacity (the profile's blocks)."""
    from skymesh.hardware import PROFILES

    kv = sim.kv_events
    assert kv is not None
    host = f"[{sim.host}]" if ":" in sim.host else sim.host
    profile = PROFILES.get(sim.profile)
    return KvEventsEndpoint(
        endpoint=f"tcp://{host}:{kv.port}",
        replay_endpoint=None if kv.replay_port is None else f"tcp://{host}:{kv.replay_port}",
        topic=kv.topic,
        **({"max_blocks": profile.num_gpu_blocks} if profile is not None else {}))


class ReplicaConfig(ConfigModel):
    id: ReplicaId
    # base URL of the OpenAI-compatible server; for a sim replica derived from sim.host/port
    url: DerivedHttpUrl = Field(default=None, description="exactly one of url or sim")
    sim: SimReplica | None = None
    # the replica's KV-event publisher (optional): exact cache state instead of the
    # balancer's routing history
    kv_events: KvEventsEndpoint | None = None

    @model_validator(mode="after")
    def _url_or_sim(self) -> ReplicaConfig:
        if (self.url is None) == (self.sim is None):
            raise ConfigError("", "exactly one of 'url' (a real vLLM server) or 'sim' is required")
        if self.sim is not None:
            _derive(self, "url", f"http://{self.sim.host}:{self.sim.port}")
            if self.sim.kv_events is not None:
                if self.kv_events is not None:
                    raise ConfigError("kv_events", "a sim replica's kv_events follow from sim.kv_events; "
                                                   "set only that")
                _derive(self, "kv_events", _sim_kv_events(self.sim))
        return self


class BalancerConfig(ConfigModel):
    listen: HostPortField  # HTTP (OpenAI API, admin, metrics)
    grpc_listen: HostPortField  # balancer<->balancer heartbeats
    # what clients, peers and DNS use (default: listen / grpc_listen). With
    # emulate_latency, `skymesh up` puts a delay proxy on these addresses in front of
    # `listen` / `grpc_listen`.
    advertise: DerivedHostPort = Field(default=None, description="default: listen")
    grpc_advertise: DerivedHostPort = Field(default=None, description="default: grpc_listen")
    # the address DNS publishes for clients (a public IP in the cloud); None: advertise host
    public_ip: IpAddress | None = None
    # HTTPS listener for peer balancers' forwarded requests only (mTLS under the mesh CA
    # with tls set; plain HTTP on loopback without it); forwards are refused on `listen`.
    # Required in a mesh that offloads (more than one region, offload enabled).
    peer_listen: HostPortField | None = None
    # where peers send their forwards (default: peer_listen); a delay proxy with
    # emulate_latency, like advertise
    peer_advertise: DerivedHostPort = Field(default=None, description="default: peer_listen")

    @model_validator(mode="after")
    def _advertise_defaults_to_listen(self) -> BalancerConfig:
        if self.advertise is None:
            _derive(self, "advertise", self.listen)
        if self.grpc_advertise is None:
            _derive(self, "grpc_advertise", self.grpc_listen)
        if self.peer_advertise is None:
            _derive(self, "peer_advertise", self.peer_listen)
        elif self.peer_listen is None:
            raise ConfigError("peer_advertise", "needs peer_listen (the listener it reaches)")
        return self

    @property
    def advertise_url(self) -> str:
        return self.advertise.http_url


class RegionConfig(ConfigModel):
    name: RegionName
    source_networks: Annotated[tuple[Network, ...], Field(min_length=1)]
    balancer: BalancerConfig
    replicas: Annotated[tuple[ReplicaConfig, ...], Field(min_length=1)]
    aws_region: AwsRegion | None = None
    # source address this region's balancer binds when it connects to peers, so a delay
    # proxy (or a real network) can tell which region traffic comes from
    egress_source: IpAddress | None = None

    @model_validator(mode="after")
    def _check(self) -> RegionConfig:
        repeat = _first_repeat(rep.id for rep in self.replicas)
        if repeat is not None:
            i, first = repeat
            raise ConfigError(
                f"replicas[{i}].id", f"duplicate replica id {self.replicas[i].id!r} (also at index {first})"
            )
        if self.egress_source is not None:
            egress = ipaddress.ip_address(self.egress_source)
            if not any(egress in net for net in self.source_networks):
                raise ConfigError(
                    "egress_source", f"{self.egress_source} is not inside this region's source_networks"
                )
        return self


class LatencyConfig(ConfigModel):
    """One-way latency between two regions (symmetric)."""

    regions: tuple[Text, ...]
    one_way_ms: Annotated[Float, Field(ge=0, le=10_000)]

    @model_validator(mode="after")
    def _two_regions(self) -> LatencyConfig:
        if len(self.regions) != 2:
            raise ConfigError("regions", f"expected two region names, got {len(self.regions)}")
        if self.regions[0] == self.regions[1]:
            raise ConfigError("regions", "a latency needs two different regions")
        return self


class OffloadRule(ConfigModel):
    source: Text = Field(alias="from", description="glob over region names, e.g. eu-*")
    allowed_targets: tuple[Text, ...] = Field(alias="to", description="globs")

    def matches_source(self, region: str) -> bool:
        return fnmatch.fnmatchcase(region, self.source)

    def allows(self, target: str) -> bool:
        return any(fnmatch.fnmatchcase(target, g) for g in self.allowed_targets)


class OffloadConfig(ConfigModel):
    enabled: Bool = True
    # tau: a remote region with more requests queued at its balancer is not a target.
    max_remote_queue: Annotated[Int, Field(ge=0)] = 4
    heartbeat_interval_s: Annotated[Float, Field(ge=0.01, le=60)] = 0.1
    # a peer missing this many heartbeat intervals is unavailable
    heartbeat_miss_limit: Annotated[Int, Field(ge=1, le=100)] = 3
    # when to forward a queued request: "predicted_ttft" when a peer is expected to answer
    # it sooner (link RTT + its queue + uncached prefill vs the wait here), "saturated"
    # only when no local replica is available (SkyWalker's rule); see routing/offload.py
    trigger: Literal["predicted_ttft", "saturated"] = "predicted_ttft"
    # predicted_ttft: how much sooner a peer must be expected to answer before we forward
    min_gain_s: Annotated[Float, Field(ge=0, le=60)] = 0.0
    rules: tuple[OffloadRule, ...] = ()

    def allowed(self, source: str, target: str) -> bool:
        """First rule whose source glob matches decides; no matching rule allows all."""
        for rule in self.rules:
            if rule.matches_source(source):
                return rule.allows(target)
        return True


class PolicyConfig(ConfigModel):
    name: str = Field(default="dualmap", json_schema_extra={"enum": list(POLICIES)})
    ttft_slo_s: Annotated[Float, Field(ge=0.001)] = 2.0
    probe_interval_s: Annotated[Float, Field(ge=0.005, le=60)] = 0.1
    queue_bound: Annotated[Int, Field(ge=1)] = 1024
    # prompt chunking for prefix hashing, in tokens of the documented tokenizer contract
    chunk_tokens: Annotated[Int, Field(ge=1, le=1 << 20)] = 64
    # bound on prefix-trie nodes per balancer (memory stays bounded)
    trie_max_nodes: Annotated[Int, Field(ge=16)] = 200_000
    max_body_bytes: Annotated[Int, Field(ge=1024)] = 4 * 1024 * 1024
    max_retries: Annotated[Int, Field(ge=0, le=16)] = 2
    # the named policy's knobs, validated by its options model in the policy registry
    # SerializeAsAny: dumped as the policy's own options model, not the shared base
    options: SerializeAsAny[PolicyOptions] = Field(
        default_factory=dict,
        validate_default=True,
        description="options of the named policy (see skymesh/routing/policies/)",
    )

    @field_validator("name", mode="before")
    @classmethod
    def _registered(cls, name: Any) -> Any:
        if isinstance(name, str) and name not in POLICIES:
            raise ConfigError("", f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
        return name

    @field_validator("options", mode="plain", json_schema_input_type=dict[str, Any])
    @classmethod
    def _typed_options(cls, raw: Any, info: ValidationInfo) -> PolicyOptions:
        name = info.data.get("name")
        if name is None:  # the name is wrong; that error is the one reported
            return PolicyOptions()
        if not isinstance(raw, (Mapping, PolicyOptions)):
            raise ConfigError("", f"expected a mapping, got {kind(raw)}")
        # a PolicyOptionsError carries the option's path; it is prefixed with policy.options
        return policy_options(name, raw)


class QueueConfig(ConfigModel):
    """The order of the balancer's queue within a priority (skymesh/routing/queue_registry.py
    names the disciplines; each reads its options of these keys)."""

    # "fcfs": arrival order; "slo": each head window ordered for SLO attainment; "prefix"
    # (FEATHER): a replica that frees up gets the queued request it holds the most of first
    discipline: DisciplineName = "fcfs"
    # slo: how many requests at the head of each priority are ordered
    window: Annotated[Int, Field(ge=2, le=64)] = DEFAULT_WINDOW
    # slo: the search's budget per decision, in schedule evaluations (annealing, then as many
    # again at most for the polish; see skymesh/routing/disciplines/slo_deadline.py)
    iterations: Annotated[Int, Field(ge=0, le=100_000)] = DEFAULT_ITERATIONS
    # slo and prefix: the starvation bound: a request queued this long goes first, in arrival order
    max_age_s: Annotated[Float, Field(gt=0, le=3600)] = DEFAULT_MAX_AGE_S
    # prefix: a request that has waited this share of its TTFT target (its class's, else
    # policy.ttft_slo_s) also goes first, in arrival order: ordering by cache match alone
    # lowers the median TTFT but lets the unmatched requests' tail run past their targets
    prefix_ttft_share: Annotated[Float, Field(gt=0, le=1)] = DEFAULT_PREFIX_TTFT_SHARE


class HealthConfig(ConfigModel):
    """Replica health with hysteresis (Envoy's thresholds): failed probes and connection
    failures both count; one bad probe only pauses dispatch until the next good one."""

    unhealthy_threshold: Annotated[Int, Field(ge=1, le=100)] = 3
    healthy_threshold: Annotated[Int, Field(ge=1, le=100)] = 2


class UpstreamConfig(ConfigModel):
    """Timeouts of one attempt on a replica or a peer balancer."""

    connect_timeout_s: Annotated[Float, Field(gt=0, le=60)] = 2.0
    # streaming: until the first chunk; non-streaming: plus per_output_token_s * max_tokens
    first_byte_timeout_s: Annotated[Float, Field(gt=0, le=3600)] = 60.0
    # upper bound of the replicas' decode time per token (None: from the stand-in
    # profile when the replicas name one, else 0.2 s)
    per_output_token_s: Annotated[Float, Field(gt=0, le=60)] | None = None
    # once streaming, the longest silence between two chunks
    stream_idle_timeout_s: Annotated[Float, Field(gt=0, le=3600)] = 60.0
    # a request still queued at the balancer this long after arrival gets 504
    # (None: max(60 s, 30 x policy.ttft_slo_s))
    max_queue_wait_s: Annotated[Float, Field(gt=0, le=3600)] | None = None
    # output tokens assumed for a chat request without max_tokens / max_completion_tokens:
    # vLLM then generates up to the end of the context (max_model_len - prompt), which the
    # balancer does not know; this bounds its non-streaming deadline and load estimate
    unbounded_chat_max_tokens: Annotated[Int, Field(ge=1, le=1 << 20)] = 8192


class ControllerConfig(ConfigModel):
    listen: HostPortField  # gRPC
    http_listen: HostPortField  # JSON status for `skymesh status`
    state_path: Text = ".skymesh/controller.sqlite"
    probe_interval_s: Annotated[Float, Field(ge=0.05, le=600)] = 1.0
    failure_threshold: Annotated[Int, Field(ge=1, le=100)] = 3


class DnsConfig(ConfigModel):
    name: DnsName
    provider: Literal["embedded", "route53"] = "embedded"
    listen: HostPortField | None = None  # embedded server address
    ttl_s: Annotated[Int, Field(ge=1, le=86400)] = 5
    hosted_zone: Text | None = None  # route53
    # route53 API endpoint override (an emulator on loopback in tests); None: AWS
    endpoint_url: HttpUrlStr | None = None
    # route53 routing: "latency" (every region, nearest healthy answers) or "failover"
    # (exactly two regions: PRIMARY = first alive in config order, SECONDARY the other)
    routing: Literal["latency", "failover"] = "latency"

    @model_validator(mode="after")
    def _provider_needs(self) -> DnsConfig:
        if self.provider == "embedded" and self.listen is None:
            raise ConfigError("listen", "is required for the embedded DNS server")
        if self.provider == "route53" and self.hosted_zone is None:
            raise ConfigError("hosted_zone", "is required for provider route53")
        if self.routing == "failover" and self.provider != "route53":
            raise ConfigError("routing", "failover routing is a Route53 record type; use provider route53")
        return self


class CertKeyFiles(ConfigModel):
    """One component's PEM files (paths, relative to the working directory)."""

    cert: Text
    key: Text


class TlsConfig(ConfigModel):
    """Mesh identity: mTLS on every gRPC channel and every peer forward (HTTPS between
    balancers) under one mesh CA (see skymesh/pki.py).

    File paths only; each component reads its own files when it starts, so a host needs
    only the CA certificate and its own key pair. ``skymesh up`` generates all of them.
    """

    ca_cert: Text
    controller: CertKeyFiles
    # region name -> its balancer's files (the certificate names that region)
    balancers: dict[RegionName, CertKeyFiles]
    # an operator's client certificate (status tools); optional
    admin: CertKeyFiles | None = None


# ----------------------------------------------------------------------------- trust: clients, admin


SHA256_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
ENV_VAR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# an SLO class name travels in a header and becomes a metrics label: short and plain
SLO_CLASS_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
Sha256Hex = Annotated[
    Text,
    AfterValidator(_matching(SHA256_HEX_RE, "a lowercase hex SHA-256 digest (64 characters)")),
    Field(json_schema_extra={"pattern": SHA256_HEX_RE.pattern}),
]
EnvVarName = Annotated[
    Text,
    AfterValidator(_matching(ENV_VAR_RE, "an environment variable name")),
    Field(json_schema_extra={"pattern": ENV_VAR_RE.pattern}),
]


SloClassName = Annotated[
    Text,
    AfterValidator(_matching(SLO_CLASS_RE, "a lowercase name like chat or code-completion (at most 32 characters)")),
    Field(json_schema_extra={"pattern": SLO_CLASS_RE.pattern}),
]


class SloClassConfig(ConfigModel):
    """One service-level class: the targets its requests are judged by, and its priority.
    Any of the three targets; a class names at least one."""

    # time to first token
    ttft_s: Annotated[Float, Field(gt=0, le=3600)] | None = None
    # time per output token after the first
    tpot_s: Annotated[Float, Field(gt=0, le=60)] | None = None
    # arrival to the last byte of the answer
    e2e_s: Annotated[Float, Field(gt=0, le=86_400)] | None = None
    # higher first: a queued request of a higher priority is placed before any of a lower
    priority: Annotated[Int, Field(ge=-1000, le=1000)] = 0

    @model_validator(mode="after")
    def _some_target(self) -> SloClassConfig:
        if self.ttft_s is None and self.tpot_s is None and self.e2e_s is None:
            raise ConfigError("ttft_s", "an SLO class needs at least one target (ttft_s, tpot_s or e2e_s)")
        return self


class ClientLimits(ConfigModel):
    """Token-bucket limits of one API key; None: unlimited."""

    requests_per_second: Annotated[Float, Field(gt=0, le=1_000_000)] | None = None
    # bucket size for requests (default: max(1, requests_per_second))
    request_burst: Annotated[Int, Field(ge=1, le=1_000_000)] | None = None
    # prompt tokens (the documented tokenizer contract) per minute; the bucket holds one minute
    prompt_tokens_per_minute: Annotated[Int, Field(ge=1)] | None = None


class ClientKeyConfig(ConfigModel):
    """One client API key, stored as the SHA-256 hex digest of the key (never the key)."""

    name: Text
    sha256: Sha256Hex
    # None: client_auth.default_limits
    limits: ClientLimits | None = None
    # the SLO class of its requests without an X-SLO-Class header (None: default_slo_class)
    slo_class: SloClassName | None = None


class ClientAuthConfig(ConfigModel):
    """Client API keys for /v1/*. With no key from any source the API is open (local use)."""

    keys: tuple[ClientKeyConfig, ...] = ()
    # plaintext keys, one per line ("name:key" or "key"; '#' starts a comment)
    keys_file: Text | None = None
    # an environment variable holding plaintext keys, comma-separated ("name:key" or "key")
    keys_env: EnvVarName | None = "SKYMESH_API_KEYS"
    # limits of keys from keys_file / keys_env and of YAML keys without their own
    default_limits: ClientLimits = Field(default_factory=ClientLimits)

    @model_validator(mode="after")
    def _unique(self) -> ClientAuthConfig:
        by_name = _first_repeat(key.name for key in self.keys)
        by_digest = _first_repeat(key.sha256 for key in self.keys)
        # the earlier offending key is reported, a name before a digest at the same key
        if by_name is not None and (by_digest is None or by_name[0] <= by_digest[0]):
            i, first = by_name
            raise ConfigError(f"keys[{i}].name", f"duplicate key name {self.keys[i].name!r} (also keys[{first}])")
        if by_digest is not None:
            i, first = by_digest
            raise ConfigError(f"keys[{i}].sha256", f"the same key as keys[{first}]")
        return self


class AdminConfig(ConfigModel):
    """The admin credential (a bearer token) of /admin/*, the controller's HTTP API and
    the DNS control API. Looked up in order: the env var, the file, then (local mode)
    ``<state dir>/admin-token`` that ``skymesh up`` creates. No token: those answer 401."""

    token_env: EnvVarName = "SKYMESH_ADMIN_TOKEN"
    token_file: Text | None = None
    # /metrics: "loopback" (open to loopback clients, token otherwise), "token", "open"
    metrics_access: Literal["loopback", "token", "open"] = "loopback"


class ClientTimeoutsConfig(ConfigModel):
    """Bounds on slow clients (slowloris) at every skymesh HTTP server."""

    # from connect (or the end of the previous response) to a complete request head
    header_timeout_s: Annotated[Float, Field(gt=0, le=3600)] = 10.0
    # from the request head to the whole body
    body_timeout_s: Annotated[Float, Field(gt=0, le=3600)] = 30.0


class HttpLimitsConfig(ConfigModel):
    """Bounds on connections at every skymesh HTTP server (balancer, controller, DNS
    control API): memory under a flood is bounded by these, not by the attacker
    (skymesh/edge/server.py)."""

    # open connections in all, and from one source address; over either: 503 and close
    max_connections: Annotated[Int, Field(ge=1, le=1_000_000)] = 4096
    max_connections_per_source: Annotated[Int, Field(ge=1, le=1_000_000)] = 1024
    # bytes of one incomplete request head (request line and header fields); over: 431
    max_head_bytes: Annotated[Int, Field(ge=1024, le=16 * 1024 * 1024)] = 64 * 1024


class TokenizerConfig(ConfigModel):
    """How the balancer counts and hashes prompts (skymesh/prompt_tokens.py). Local files
    only, read when the balancer starts; never fetched."""

    # the model's HF tokenizer.json; without it, prompts are hashed as UTF-8 bytes
    path: Text | None = None
    # the model's chat template (jinja2) for chat requests; needs ``path``
    chat_template: Text | None = None
    # the fallback's estimate of UTF-8 bytes per token (and chunk size in bytes per token)
    bytes_per_token: Annotated[Float, Field(gt=0, le=16)] = 4.0

    @model_validator(mode="after")
    def _template_needs_tokenizer(self) -> TokenizerConfig:
        if self.chat_template is not None and self.path is None:
            raise ConfigError("chat_template", "a chat template needs the tokenizer (tokenizer.path) too")
        return self


class MeshConfig(ConfigModel):
    model: Text = "skymesh-sim"
    # the model's tokenizer for token-true prefix hashing (default: UTF-8 byte chunks)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    regions: Annotated[tuple[RegionConfig, ...], Field(min_length=1)]
    # one-way latency for every pair of distinct regions
    latencies: tuple[LatencyConfig, ...] = ()
    # one-way latency from a client to the balancer of its own region
    local_latency_ms: Annotated[Float, Field(ge=0, le=1000)] = 1.0
    controller: ControllerConfig
    dns: DnsConfig
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    # the shared secret of forwarded requests and the DNS control API; no default is
    # shipped: $SKYMESH_PEER_TOKEN, this, or the local-mode file (skymesh/admin_auth.py)
    peer_token: Annotated[Text, Field(min_length=16)] | None = None
    client_auth: ClientAuthConfig = Field(default_factory=ClientAuthConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    client_timeouts: ClientTimeoutsConfig = Field(default_factory=ClientTimeoutsConfig)
    http_limits: HttpLimitsConfig = Field(default_factory=HttpLimitsConfig)
    emulate_latency: Bool = True
    # mTLS credentials of the mesh (gRPC and peer forwards); None: gRPC and the peer
    # listeners only on loopback, without TLS
    tls: TlsConfig | None = None
    # SLO classes by name; a request names one in X-SLO-Class, else its API key's, else
    # default_slo_class (none configured: requests carry no class)
    slo_classes: dict[SloClassName, SloClassConfig] = Field(default_factory=dict)
    default_slo_class: SloClassName | None = None
    # Mooncake's early rejection: a request whose class's TTFT target no replica here or at a
    # peer can meet even at best is answered 429 at once; false: it is queued anyway
    slo_early_rejection: Bool = True

    # (a, b) with a < b -> one-way ms, built from `latencies` by the validator
    _latency_ms: dict[tuple[str, str], float] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _cross_checks(self) -> MeshConfig:
        names = [region.name for region in self.regions]
        repeat = _first_repeat(names)
        if repeat is not None:
            i, first = repeat
            raise ConfigError(f"regions[{i}].name", f"duplicate region {names[i]!r} (also regions[{first}])")
        _check_unique_endpoints(self.regions)
        self._latency_ms = _latency_table(self.latencies, self.regions)
        for i, rule in enumerate(self.offload.rules):
            if not any(fnmatch.fnmatchcase(n, rule.source) for n in names):
                raise ConfigError(f"offload.rules[{i}].from", f"pattern {rule.source!r} matches no configured region")
        _check_slo_class_names(self)
        if self.offload.enabled and len(self.regions) > 1:
            for i, r in enumerate(self.regions):
                if r.balancer.peer_listen is None:
                    raise ConfigError(f"regions[{i}].balancer.peer_listen",
                                      "is required when offload is enabled: peers forward requests to this "
                                      "listener (mTLS), never to the client port")
        if self.dns.routing == "failover" and len(self.regions) != 2:
            raise ConfigError(
                "dns.routing", f"failover routing needs exactly 2 regions, the config has {len(self.regions)}"
            )
        return self

    @model_validator(mode="after")
    def _tls_names_every_region(self) -> MeshConfig:
        if self.tls is not None:
            names = [r.name for r in self.regions]
            for name in self.tls.balancers:
                if name not in names:
                    raise ConfigError(f"tls.balancers.{name}", f"unknown region {name!r}")
            for name in names:
                if name not in self.tls.balancers:
                    raise ConfigError("tls.balancers", f"missing the certificate of region {name!r}")
        return self

    @property
    def latency_ms(self) -> dict[tuple[str, str], float]:
        """One-way ms for every pair of distinct regions, keyed (a, b) with a < b."""
        return self._latency_ms

    def source_network_table(self) -> SourceNetworkTable:
        """(network, region) over every region's source_networks, most specific first."""
        return sorted(((n, r.name) for r in self.regions for n in r.source_networks),
                      key=lambda x: -x[0].prefixlen)

    def region(self, name: str) -> RegionConfig:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def one_way_ms(self, a: str, b: str) -> float:
        if a == b:
            return self.local_latency_ms
        return self._latency_ms[(a, b) if a < b else (b, a)]

    def rtt_ms(self, a: str, b: str) -> float:
        return 2 * self.one_way_ms(a, b)


def _check_slo_class_names(cfg: MeshConfig) -> None:
    known = cfg.slo_classes
    listed = ", ".join(sorted(known)) or "none configured"
    if cfg.default_slo_class is not None and cfg.default_slo_class not in known:
        raise ConfigError("default_slo_class", f"unknown SLO class {cfg.default_slo_class!r} (slo_classes: {listed})")
    for i, key in enumerate(cfg.client_auth.keys):
        if key.slo_class is not None and key.slo_class not in known:
            raise ConfigError(f"client_auth.keys[{i}].slo_class",
                              f"unknown SLO class {key.slo_class!r} (slo_classes: {listed})")


def _latency_table(
    latencies: tuple[LatencyConfig, ...], regions: tuple[RegionConfig, ...]
) -> dict[tuple[str, str], float]:
    names = {r.name for r in regions}
    table: dict[tuple[str, str], float] = {}
    for i, entry in enumerate(latencies):
        a, b = entry.regions
        for j, name in enumerate((a, b)):
            if name not in names:
                raise ConfigError(f"latencies[{i}].regions[{j}]", f"unknown region {name!r}")
        key = (a, b) if a < b else (b, a)
        if key in table:
            raise ConfigError(f"latencies[{i}].regions", f"latency between {a} and {b} given twice")
        table[key] = float(entry.one_way_ms)
    for i, ra in enumerate(regions):
        for rb in regions[i + 1 :]:
            key = (ra.name, rb.name) if ra.name < rb.name else (rb.name, ra.name)
            if key not in table:
                raise ConfigError("latencies", f"missing one-way latency between {key[0]} and {key[1]}")
    return table


def _check_unique_endpoints(regions: tuple[RegionConfig, ...]) -> None:
    used: dict[tuple[str, int], str] = {}

    def claim(hp: HostPort, path: str) -> None:
        # only loopback addresses are known to share one machine (the local mesh);
        # 0.0.0.0:8000 on two different cloud hosts is fine
        if not hp.host.startswith("127.") and hp.host != "localhost":
            return
        key = (hp.host, hp.port)
        if key in used:
            raise ConfigError(path, f"address {hp} is already used by {used[key]}")
        used[key] = path

    for i, r in enumerate(regions):
        b = r.balancer
        claim(b.listen, f"regions[{i}].balancer.listen")
        claim(b.grpc_listen, f"regions[{i}].balancer.grpc_listen")
        if b.advertise != b.listen:
            claim(b.advertise, f"regions[{i}].balancer.advertise")
        if b.grpc_advertise != b.grpc_listen:
            claim(b.grpc_advertise, f"regions[{i}].balancer.grpc_advertise")
        if b.peer_listen is not None:
            claim(b.peer_listen, f"regions[{i}].balancer.peer_listen")
        if b.peer_advertise is not None and b.peer_advertise != b.peer_listen:
            claim(b.peer_advertise, f"regions[{i}].balancer.peer_advertise")
        for j, rep in enumerate(r.replicas):
            if rep.sim is not None:
                claim(HostPort(rep.sim.host, rep.sim.port), f"regions[{i}].replicas[{j}].sim.port")


# ----------------------------------------------------------------------------- loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML forbids it,
    and PyYAML would keep the last silently (a second ``offload:`` or ``slo_classes:``
    pasted at the end of a file would replace the first without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *anchor": keys given beside it override the merged ones
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: the base constructor reports it
                break
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (given before in this mapping)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_config(data: Any, profiles: set[str] | None = None) -> MeshConfig:
    """Validate a parsed YAML document into a :class:`MeshConfig`.

    ``profiles``: the replica-sim profile names a sim replica may use (default: the
    packaged ones).
    """
    context = None if profiles is None else {"profiles": profiles}
    try:
        return MeshConfig.model_validate(data, context=context)
    except ValidationError as e:
        path, message = first_error(e)
        raise ConfigError(path or "<root>", message) from None


def config_schema() -> dict[str, Any]:
    """The JSON schema of the config file (``skymesh config --schema``)."""
    return MeshConfig.model_json_schema()


def load_config(path: str | Path | None = None) -> MeshConfig:
    """Load a YAML file; ``None`` loads the embedded local 3-region default."""
    return load_config_digest(path)[0]


def load_config_digest(path: str | Path | None = None) -> tuple[MeshConfig, str]:
    """:func:`load_config`, and the SHA-256 (hex) of the bytes it parsed: what a daemon
    names its loaded config by (/admin/status, the controller's status, reload logs)."""
    if path is None:
        raw = resources.files("skymesh").joinpath("local.yaml").read_bytes()
        src = "<embedded local.yaml>"
    else:
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise ConfigError("", f"cannot read config {p}: {e.strerror}") from None
        src = str(p)
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise ConfigError("", f"{src} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{src} is not valid YAML: {e}") from None
    return parse_config(data), hashlib.sha256(raw).hexdigest()
