"""Trust: the mesh's mTLS files, client API keys (stored as SHA-256 digests) with their
rate limits and SLO class, the admin token, and the peer token of forwarded requests."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from skymesh.config.base import ConfigError, ConfigModel, Float, Int, Text, first_repeat, matching
from skymesh.config.region import RegionName
from skymesh.config.slo import SloClassName


class CertKeyFiles(ConfigModel):
    """One component's PEM files (paths, relative to the working directory)."""

    cert: Text
    key: Text


class TlsConfig(ConfigModel):
    """Mesh identity: mTLS on every gRPC channel and every peer forward (HTTPS between
    balancers) under one mesh CA (see skymesh/security/pki.py).

    File paths only; each component reads its own files when it starts, so a host needs
    only the CA certificate and its own key pair. ``skymesh up`` generates all of them.
    """

    ca_cert: Text
    controller: CertKeyFiles
    # region name -> its balancer's files (the certificate names that region)
    balancers: dict[RegionName, CertKeyFiles]
    # an operator's client certificate (status tools); optional
    admin: CertKeyFiles | None = None


SHA256_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
ENV_VAR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


Sha256Hex = Annotated[
    Text,
    AfterValidator(matching(SHA256_HEX_RE, "a lowercase hex SHA-256 digest (64 characters)")),
    Field(json_schema_extra={"pattern": SHA256_HEX_RE.pattern}),
]
EnvVarName = Annotated[
    Text,
    AfterValidator(matching(ENV_VAR_RE, "an environment variable name")),
    Field(json_schema_extra={"pattern": ENV_VAR_RE.pattern}),
]


# the shared secret of forwarded requests and the DNS control API (MeshConfig.peer_token)
PeerToken = Annotated[Text, Field(min_length=16)]


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
        by_name = first_repeat(key.name for key in self.keys)
        by_digest = first_repeat(key.sha256 for key in self.keys)
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
