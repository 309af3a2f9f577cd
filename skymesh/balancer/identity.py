"""Who this balancer is in its region's fleet: its id and the host its siblings and the
controller reach it at.

A balancer the config lists (``balancer:`` or ``balancer.siblings``) is that member. A
region whose ``balancer.fleet`` is ``registered`` lists none (an Auto Scaling group: every
instance boots from one config): each balancer then names itself, in this order

- id: ``--balancer-id``, else ``SKYMESH_BALANCER_ID``, else the EC2 instance id;
- host: ``--advertise-host``, else ``SKYMESH_ADVERTISE_HOST``, else its listen host when
  that is no wildcard, else the instance's private IPv4.

The instance's values come from the instance metadata service (IMDSv2: a session token
by PUT, then GETs carrying it) with a short timeout, so a balancer off EC2 starts within
about a second without them. ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` moves the service
(the AWS SDKs' variable; tests point it at a loopback stand-in) and
``AWS_EC2_METADATA_DISABLED=true`` turns it off. A balancer left without an id gets a
fresh one per process (a restart is then a new member; the old record dies with its
reports); one without a reachable host is never dialled by its siblings.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from skymesh.config import MeshConfig

log = logging.getLogger("skymesh.balancer.identity")

BALANCER_ID_ENV = "SKYMESH_BALANCER_ID"
ADVERTISE_HOST_ENV = "SKYMESH_ADVERTISE_HOST"
IMDS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
IMDS_DISABLED_ENV = "AWS_EC2_METADATA_DISABLED"
IMDS_DEFAULT_ENDPOINT = "http://169.254.169.254"
# each IMDS call; the service answers in milliseconds on EC2 and not at all elsewhere
IMDS_TIMEOUT_S = 0.5
IMDS_TOKEN_TTL_S = 60
INSTANCE_ID_RE = re.compile(r"^i-[0-9a-f]{8,17}$")
BALANCER_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass(frozen=True, slots=True)
class InstanceMetadata:
    instance_id: str | None
    private_ipv4: str | None


@dataclass(frozen=True, slots=True)
class MemberIdentity:
    """``balancer_id``: None for a fresh one per process; ``advertise_host``: None when no
    reachable host is known (the listen host then, unless it is a wildcard)."""

    balancer_id: str | None
    advertise_host: str | None
    id_source: str  # flag, env, config, imds, none
    host_source: str  # flag, env, imds, none


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is a bind-everything address (0.0.0.0, ::) or empty: never dialled."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a host name


def _reachable_ip(text: str) -> str | None:
    try:
        ip = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    return None if ip.is_unspecified or ip.is_multicast else str(ip)


def read_imds(endpoint: str, timeout_s: float = IMDS_TIMEOUT_S) -> InstanceMetadata | None:
    """The instance id and private IPv4 from IMDSv2 at ``endpoint``; None when it does not
    answer (not on EC2, or the service is off). A value that does not look like one is left
    out."""
    base = endpoint.rstrip("/")
    try:
        req = urllib.request.Request(base + "/latest/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL_S)})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 (a configured http URL)
            token = r.read(4096).decode("ascii", "replace").strip()

        def get(path: str) -> str | None:
            req = urllib.request.Request(base + "/latest/meta-data/" + path,
                                         headers={"X-aws-ec2-metadata-token": token})
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310
                    return str(r.read(4096).decode("ascii", "replace").strip())
            except urllib.error.HTTPError:
                return None  # e.g. 404: no such item on this instance

        instance_id = get("instance-id")
        ipv4 = get("local-ipv4")
    except (urllib.error.URLError, OSError, ValueError) as e:
        log.info("no instance metadata", extra={"endpoint": base, "error": type(e).__name__})
        return None
    return InstanceMetadata(instance_id if instance_id and INSTANCE_ID_RE.match(instance_id) else None,
                            _reachable_ip(ipv4) if ipv4 else None)


def resolve_identity(cfg: MeshConfig, region: str, member: int, *, listen_host: str,
                     balancer_id: str | None = None, advertise_host: str | None = None,
                     environ: Mapping[str, str] | None = None,
                     imds: Callable[[str], InstanceMetadata | None] = read_imds) -> MemberIdentity:
    """This balancer's id and reachable host (see the module docstring for the order).
    ``member``: its index in the config's list; ``listen_host``: the host its listeners
    bind; ``balancer_id`` / ``advertise_host``: the command line's. The metadata service is
    asked at most once, and only for what is missing: a registered fleet's id, a wildcard
    listener's host."""
    env = environ if environ is not None else {}
    rc = cfg.region(region)
    registered = rc.balancer.fleet == "registered"
    members = rc.balancer_members

    bid, id_source = balancer_id, "flag"
    if not bid and env.get(BALANCER_ID_ENV):
        bid, id_source = env[BALANCER_ID_ENV], "env"
    if not bid and not registered and len(members) > 1:
        bid, id_source = members[member].id, "config"
    if bid is not None and not BALANCER_ID_RE.match(bid):
        raise ValueError(f"balancer id {bid[:80]!r}: letters, digits, '.', '_' or '-' (at most 128)")

    host, host_source = advertise_host, "flag"
    if not host and env.get(ADVERTISE_HOST_ENV):
        host, host_source = env[ADVERTISE_HOST_ENV], "env"
    if host is not None and is_wildcard(host):
        raise ValueError(f"advertised host {host!r} is a wildcard: siblings cannot dial it")

    need_id = registered and not bid
    need_host = not host and is_wildcard(listen_host)
    if (need_id or need_host) and env.get(IMDS_DISABLED_ENV, "").lower() not in ("true", "1"):
        meta = imds(env.get(IMDS_ENDPOINT_ENV) or IMDS_DEFAULT_ENDPOINT)
        if meta is not None:
            if need_id and meta.instance_id:
                bid, id_source = meta.instance_id, "imds"
            if need_host and meta.private_ipv4:
                host, host_source = meta.private_ipv4, "imds"
    if not bid:
        bid, id_source = None, "none"
        if registered:
            log.warning("no stable balancer id (--balancer-id, SKYMESH_BALANCER_ID or the EC2 instance id): "
                        "a fresh one per process", extra={"region": region})
    if not host:
        host, host_source = None, "none"
        if is_wildcard(listen_host):
            log.warning("no reachable address (--advertise-host, SKYMESH_ADVERTISE_HOST or the EC2 private "
                        "IPv4) and a wildcard listener: siblings cannot dial this balancer",
                        extra={"region": region})
    return MemberIdentity(bid, host, id_source, host_source)


def member_host(advertise_host: str | None, listen_host: str) -> str | None:
    """The host this balancer's siblings and the controller dial: the resolved one, else a
    listen host that is no wildcard; None: none."""
    if advertise_host:
        return advertise_host
    return None if is_wildcard(listen_host) else listen_host
