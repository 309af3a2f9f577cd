"""Client API keys for the balancer's OpenAI API.

Keys are held as SHA-256 digests only: from the YAML (``client_auth.keys[].sha256``), or
hashed at start from plaintext in ``client_auth.keys_file`` / the ``client_auth.keys_env``
variable. A presented key is hashed and compared with every configured digest with
:func:`hmac.compare_digest` (no early exit), so timing says nothing about which digest, or
how much of one, matched. No key from any source: the API is open (local use).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from skymesh.config import ClientAuthConfig, ClientLimits, ConfigError
from skymesh.edge.openai_errors import error_response


@dataclass(frozen=True, slots=True)
class ClientKey:
    name: str
    digest: bytes  # SHA-256 of the key
    limits: ClientLimits
    # the SLO class of its requests that name none (None: the config's default class)
    slo_class: str | None = None


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _plaintext_entries(entries: list[str], source: str) -> list[tuple[str, str]]:
    """("name:key" | "key") entries -> (name, key); unnamed keys are named by position."""
    out = []
    for i, entry in enumerate(entries, 1):
        name, sep, key = entry.partition(":")
        if not sep:
            name, key = f"{source}-{i}", entry
        name, key = name.strip(), key.strip()
        if not key or not name:
            raise ConfigError(f"client_auth.{source}", f"entry {i} has an empty name or key")
        out.append((name, key))
    return out


class ClientKeyring:
    def __init__(self, keys: list[ClientKey]) -> None:
        names = [k.name for k in keys]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError("client_auth", f"key name {dupes[0]!r} is used twice")
        self.keys = keys

    @classmethod
    def from_config(cls, cfg: ClientAuthConfig, environ: Mapping[str, str] = os.environ) -> ClientKeyring:
        keys = [
            ClientKey(k.name, bytes.fromhex(k.sha256), k.limits or cfg.default_limits, k.slo_class)
            for k in cfg.keys
        ]
        plain: list[tuple[str, str]] = []
        if cfg.keys_file is not None:
            try:
                lines = Path(cfg.keys_file).expanduser().read_text().splitlines()
            except OSError as e:
                # a configured key file that cannot be read must not leave the API open
                raise ConfigError("client_auth.keys_file", f"cannot read {cfg.keys_file}: {e.strerror}") from None
            entries = [ln.split("#", 1)[0].strip() for ln in lines]
            plain += _plaintext_entries([e for e in entries if e], "keys_file")
        if cfg.keys_env is not None and environ.get(cfg.keys_env, "").strip():
            entries = [e.strip() for e in environ[cfg.keys_env].split(",")]
            plain += _plaintext_entries([e for e in entries if e], "keys_env")
        keys += [ClientKey(name, key_digest(key), cfg.default_limits) for name, key in plain]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, presented: str) -> ClientKey | None:
        digest = key_digest(presented)
        found = None
        for key in self.keys:  # every digest is compared: no early exit on a match
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


def api_key_refused(message: str) -> web.Response:
    """The 401 for a missing or wrong client API key, as OpenAI answers it (type
    "invalid_request_error", code "invalid_api_key")."""
    return error_response(401, message, code="invalid_api_key", error_type="invalid_request_error",
                          headers={"WWW-Authenticate": 'Bearer realm="skymesh"'})


def missing_key_response() -> web.Response:
    return api_key_refused("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")


def invalid_key_response() -> web.Response:
    # OpenAI says "Incorrect API key provided" and never echoes the whole key back
    return api_key_refused("Incorrect API key provided.")
