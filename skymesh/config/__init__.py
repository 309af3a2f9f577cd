"""Typed mesh configuration loaded from YAML, validated by pydantic models; this module is
the package's public surface: callers import every config name from ``skymesh.config``.

Every validation error names the exact path of the offending value
(``regions[1].replicas[0].url: expected an http(s) URL, got 'ftp://x'``) so an operator
can fix a config without reading this code. Unknown keys are errors: a typo must never
silently fall back to a default. Config objects are frozen. ``config_schema()`` (``skymesh
config --schema``) is the JSON schema of the YAML format, for editors and CI linting.

Scalars are strict (a YAML ``"yes"`` is not a boolean, ``2.0`` is not an integer):
YAML already types them. Values the models derive (a sim replica's URL, an advertise
address defaulting to the listen address) are filled in by the models' validators.

Modules by concern, each importing only those before it: ``base`` (ConfigModel, strict
scalars, ConfigError), ``network`` (addresses), ``sim`` (the stand-in's ``sim:``),
``replica``, ``region``, ``routing``, ``control_plane`` (controller, DNS), ``slo``,
``security`` (TLS, API keys, admin and peer tokens), ``siblings`` (a region's balancers
among themselves), ``edge`` (HTTP server bounds), ``membership`` (dynamic replica
sources), ``autoscaling`` (the region's autoscaling signal), ``tracing`` (the balancers'
OpenTelemetry spans), ``mesh`` (the root and its cross-section checks), ``load`` (YAML,
schema).
"""

from skymesh.config.autoscaling import AutoscalingConfig, CloudWatchSignalConfig
from skymesh.config.base import (
    Bool,
    ConfigError,
    ConfigErrors,
    ConfigModel,
    Float,
    Int,
    Port,
    Text,
)
from skymesh.config.control_plane import ControllerConfig, DnsConfig
from skymesh.config.edge import ClientTimeoutsConfig, HttpLimitsConfig
from skymesh.config.load import (
    config_schema,
    load_config,
    load_config_digest,
    load_config_for_command,
    parse_config,
)
from skymesh.config.membership import (
    AwsGroupConfig,
    AwsSourceConfig,
    MembershipConfig,
    RegistrationConfig,
)
from skymesh.config.mesh import MeshConfig
from skymesh.config.network import (
    DNS_NAME_RE,
    DerivedHostPort,
    DerivedHttpUrl,
    DnsName,
    HostPort,
    HostPortField,
    HttpUrlStr,
    IpAddress,
    Network,
)
from skymesh.config.region import (
    REGION_NAME_RE,
    AwsRegion,
    BalancerConfig,
    BalancerId,
    BalancerMember,
    LatencyConfig,
    RegionConfig,
    RegionName,
    SiblingBalancerConfig,
)
from skymesh.config.replica import REPLICA_ID_RE, KvEventsEndpoint, ReplicaConfig, ReplicaId
from skymesh.config.routing import (
    HealthConfig,
    OffloadConfig,
    OffloadRule,
    PolicyConfig,
    QueueConfig,
    TokenizerConfig,
    UpstreamConfig,
)
from skymesh.config.security import (
    ENV_VAR_RE,
    SHA256_HEX_RE,
    AdminConfig,
    CertKeyFiles,
    ClientAuthConfig,
    ClientKeyConfig,
    ClientLimits,
    EnvVarName,
    PeerToken,
    Sha256Hex,
    TlsConfig,
)
from skymesh.config.siblings import SiblingsConfig
from skymesh.config.sim import SimKvEvents, SimReplica
from skymesh.config.slo import SLO_CLASS_RE, SloClassConfig, SloClassName
from skymesh.config.tracing import TracingBatchConfig, TracingConfig
from skymesh.source_networks import SourceNetworkTable, region_of_address, source_network_of

__all__ = [
    "DNS_NAME_RE",
    "ENV_VAR_RE",
    "REGION_NAME_RE",
    "REPLICA_ID_RE",
    "SHA256_HEX_RE",
    "SLO_CLASS_RE",
    "AdminConfig",
    "AwsGroupConfig",
    "AutoscalingConfig",
    "AwsRegion",
    "AwsSourceConfig",
    "BalancerConfig",
    "BalancerId",
    "BalancerMember",
    "Bool",
    "CertKeyFiles",
    "ClientAuthConfig",
    "ClientKeyConfig",
    "ClientLimits",
    "ClientTimeoutsConfig",
    "CloudWatchSignalConfig",
    "ConfigError",
    "ConfigErrors",
    "ConfigModel",
    "ControllerConfig",
    "DerivedHostPort",
    "DerivedHttpUrl",
    "DnsConfig",
    "DnsName",
    "EnvVarName",
    "Float",
    "HealthConfig",
    "HostPort",
    "HostPortField",
    "HttpLimitsConfig",
    "HttpUrlStr",
    "Int",
    "IpAddress",
    "KvEventsEndpoint",
    "LatencyConfig",
    "MembershipConfig",
    "MeshConfig",
    "Network",
    "OffloadConfig",
    "OffloadRule",
    "PeerToken",
    "PolicyConfig",
    "Port",
    "QueueConfig",
    "RegionConfig",
    "RegionName",
    "RegistrationConfig",
    "SiblingBalancerConfig",
    "ReplicaConfig",
    "ReplicaId",
    "Sha256Hex",
    "SiblingsConfig",
    "SimKvEvents",
    "SimReplica",
    "SloClassConfig",
    "SloClassName",
    "SourceNetworkTable",
    "Text",
    "TlsConfig",
    "TokenizerConfig",
    "TracingBatchConfig",
    "TracingConfig",
    "UpstreamConfig",
    "config_schema",
    "load_config",
    "load_config_digest",
    "load_config_for_command",
    "parse_config",
    "region_of_address",
    "source_network_of",
]
