"""Addresses in a config: ``host:port`` listeners, http(s) URLs, CIDR source networks,
IP addresses and DNS names, each written as one string and parsed with the operator's
wording on error. The per-request address->region lookup is runtime, not config: it is
:mod:`skymesh.source_networks`."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlparse

from pydantic import AfterValidator, Field

from skymesh.config.base import ConfigError, Text, matching, nonempty_str, or_null, string_type


@dataclass(frozen=True)
class HostPort:
    """A parsed ``host:port`` (a listener or an advertised address); ``str()`` writes it back."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _parse_hostport(value: Any) -> HostPort:
    if isinstance(value, HostPort):
        return value
    text = nonempty_str(value)
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ConfigError("", f"expected host:port, got {text!r}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError("", f"expected a port 1-65535, got {port!r}")
    return HostPort(host.strip("[]"), int(port))


def _parse_url(value: Any) -> str:
    text = nonempty_str(value)
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
        return ipaddress.ip_network(nonempty_str(value), strict=True)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError("", f"expected a CIDR network like 10.1.0.0/16 ({e})") from None


def _parse_ip(value: Any) -> str:
    try:
        return str(ipaddress.ip_address(nonempty_str(value)))
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError("", f"expected an IP address, got {value!r}") from None


HostPortField = Annotated[HostPort, *string_type(_parse_hostport, "host:port", examples=["127.0.0.1:8000"])]
HttpUrlStr = Annotated[str, *string_type(_parse_url, "http(s) URL", examples=["http://10.0.0.5:8000"])]
# a value a validator derives when it is absent or null (its field's default is None)
DerivedHostPort = Annotated[
    HostPort, *string_type(or_null(_parse_hostport), "host:port", examples=["127.0.0.1:8000"])
]
DerivedHttpUrl = Annotated[
    str, *string_type(or_null(_parse_url), "http(s) URL", examples=["http://10.0.0.5:8000"])
]
Network = Annotated[
    ipaddress.IPv4Network | ipaddress.IPv6Network,
    *string_type(_parse_network, "CIDR network", examples=["10.1.0.0/16"]),
]
IpAddress = Annotated[str, *string_type(_parse_ip, "IP address")]


DNS_NAME_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z][a-z0-9-]{0,61}[a-z0-9]\.?$")


DnsName = Annotated[
    Text,
    AfterValidator(matching(DNS_NAME_RE, "a DNS name like llm.example.com")),
    AfterValidator(lambda name: name.rstrip(".")),
    Field(json_schema_extra={"pattern": DNS_NAME_RE.pattern}),
]
