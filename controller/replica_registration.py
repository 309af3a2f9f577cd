"""The registration source: replicas register themselves on the controller's HTTP
listener and keep a lease by registering again; deregistering drains them.

    POST   /membership/v1/replicas                         {"replica_id", "url", "region", "ttl_s"?, "role"?}
    DELETE /membership/v1/replicas/<replica_id>            drain it
    POST   /membership/v1/replicas/<replica_id>/deregister the same, for clients without DELETE

Every call needs the registration token (``membership.registration``: its env var or
file; a bearer token compared in constant time), checked before any of the body is read;
the body is then read with a bound (``max_body_bytes`` raw and decoded, the body timeout
of ``client_timeouts``) and only then parsed. Errors are OpenAI-shaped: 401 (no or wrong
token), 400 (a malformed body or field), 403 (the region does not take registrations, the
URL's host is outside ``allowed_networks``, or the id is the YAML's or another source's),
404 (deregistering an unknown id), 409 (the id is another region's, the URL another
replica's), 413/415/408 (the body), 429 (the table is full).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import urlsplit

from aiohttp import web

from controller.membership import Membership, MembershipRefused
from skymesh.config import REPLICA_ID_RE, MeshConfig
from skymesh.edge.body import BodyLimits, read_body_or_reject
from skymesh.edge.openai_errors import error_response
from skymesh.routing.pairing.base import ROLES, Role
from skymesh.security.admin_auth import bearer_of, token_from, token_matches

PATH = "/membership/v1/replicas"
MAX_URL_CHARS = 2048
_HOST_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_FIELDS = frozenset({"replica_id", "url", "region", "ttl_s", "role"})


class BadRegistration(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def resolve_registration_token(cfg: MeshConfig) -> str | None:
    """The registration token: ``registration.token_env``, then ``registration.token_file``."""
    reg = cfg.membership.registration
    return token_from(reg.token_env, reg.token_file)


def normalize_url(value: Any, cfg: MeshConfig) -> str:
    """A replica's base URL as ``scheme://host:port``; raises :class:`BadRegistration`."""
    if not isinstance(value, str) or not value:
        raise BadRegistration(400, "url must be a non-empty string", "url")
    if len(value) > MAX_URL_CHARS or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise BadRegistration(400, "url is too long or has whitespace or control characters", "url")
    try:
        u = urlsplit(value)
        port = u.port
    except ValueError:
        raise BadRegistration(400, "url is not a valid URL", "url") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise BadRegistration(400, "url must be http(s)://host:port", "url")
    if u.username is not None or u.password is not None or u.query or u.fragment or u.path not in ("", "/"):
        raise BadRegistration(400, "url must be a base URL: no user, path, query or fragment", "url")
    host = u.hostname
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
        if not _HOST_RE.match(host):
            raise BadRegistration(400, f"url host {host!r} is not an IP address or a DNS name", "url") from None
    allowed = cfg.membership.registration.allowed_networks
    if allowed and (ip is None or not any(ip in net for net in allowed)):
        raise BadRegistration(403, f"url host {host!r} is not an address inside registration.allowed_networks",
                              "url")
    port = port or (443 if u.scheme == "https" else 80)
    shown = f"[{host}]" if ip is not None and ip.version == 6 else host
    return f"{u.scheme}://{shown}:{port}"


def parse_registration(body: bytes, cfg: MeshConfig) -> tuple[str, str, str, float, Role]:
    """(replica_id, url, region, ttl_s, role) from a registration body; raises :class:`BadRegistration`."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadRegistration(400, "the body is not JSON") from None
    if not isinstance(doc, dict):
        raise BadRegistration(400, "the body must be a JSON object")
    unknown = sorted(str(k) for k in doc if k not in _FIELDS)
    if unknown:
        raise BadRegistration(400, f"unknown field {unknown[0][:64]!r} (allowed: {', '.join(sorted(_FIELDS))})",
                              unknown[0][:64])
    rid = doc.get("replica_id")
    if not isinstance(rid, str) or not REPLICA_ID_RE.match(rid) or "\n" in rid:
        raise BadRegistration(400, "replica_id must be 1-128 letters, digits, '.', '_' or '-' "
                                   "starting with a letter or digit", "replica_id")
    region = doc.get("region")
    names = [r.name for r in cfg.regions]
    if not isinstance(region, str) or region not in names:
        raise BadRegistration(400, f"region must be one of {', '.join(names)}", "region")
    reg = cfg.membership.registration
    if reg.regions is not None and region not in reg.regions:
        raise BadRegistration(403, f"region {region} does not take registrations "
                                   f"(registration.regions: {', '.join(reg.regions) or 'none'})", "region")
    url = normalize_url(doc.get("url"), cfg)
    ttl = doc.get("ttl_s", reg.default_ttl_s)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 1 <= ttl <= reg.max_ttl_s:
        raise BadRegistration(400, f"ttl_s must be a number from 1 to {reg.max_ttl_s:g}", "ttl_s")
    role = doc.get("role", "both")
    if role not in ROLES:
        raise BadRegistration(400, f"role must be one of {', '.join(ROLES)}", "role")
    return rid, url, region, float(ttl), cast(Role, role)


class RegistrationApi:
    """The HTTP handlers; ``changed`` pushes a new topology (the controller's)."""

    def __init__(self, membership: Membership, cfg: Callable[[], MeshConfig],
                 changed: Callable[[str], Awaitable[None]]) -> None:
        self.membership = membership
        self._cfg = cfg
        self._changed = changed
        self.token = resolve_registration_token(cfg())

    def reload(self, cfg: MeshConfig) -> None:
        self.token = resolve_registration_token(cfg)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(PATH, self.register)
        app.router.add_delete(PATH + "/{replica_id}", self.deregister)
        app.router.add_post(PATH + "/{replica_id}/deregister", self.deregister)

    def _denied(self, request: web.Request) -> web.Response | None:
        cfg = self._cfg()
        if not cfg.membership.registration.enabled:
            response = error_response(403, "replica registration is not enabled (membership.registration.enabled)",
                                      code="registration_disabled")
        elif token_matches(bearer_of(request), self.token):
            return None
        else:
            message = ("this endpoint needs the registration token (Authorization: Bearer <token>)" if self.token
                       else f"no registration token is configured (set {cfg.membership.registration.token_env} "
                            "or membership.registration.token_file)")
            response = error_response(401, message, code="invalid_registration_token",
                                      headers={"WWW-Authenticate": 'Bearer realm="skymesh-registration"'})
        self.membership.metrics.registrations.labels("unauthorized").inc()
        # the body is never read: close the connection after the answer
        response.force_close()
        return response

    def _refused(self, status: int, message: str, param: str | None) -> web.Response:
        self.membership.metrics.registrations.labels("rejected").inc()
        code = {400: "invalid_registration", 403: "registration_forbidden", 404: "unknown_replica",
                409: "registration_conflict", 429: "registration_table_full"}.get(status)
        return error_response(status, message, code=code, param=param)

    async def register(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        cfg = self._cfg()
        reg = cfg.membership.registration
        rejected = await read_body_or_reject(request, BodyLimits(reg.max_body_bytes,
                                                                 cfg.client_timeouts.body_timeout_s))
        if rejected is not None:
            self.membership.metrics.registrations.labels("rejected").inc()
            return rejected
        try:
            rid, url, region, ttl, role = parse_registration(await request.read(), cfg)
            changed, renewed = self.membership.register(rid, url, region, ttl, role)
        except (BadRegistration, MembershipRefused) as e:
            return self._refused(e.status, e.message, e.param)
        self.membership.metrics.registrations.labels("renewed" if renewed else "registered").inc()
        if changed:
            await self._changed(f"replica {rid} registered in {region}")
        return web.json_response({"replica_id": rid, "url": url, "region": region, "ttl_s": ttl, "role": role,
                                  "state": "active"})

    async def deregister(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        rid = request.match_info["replica_id"]
        if not REPLICA_ID_RE.match(rid) or "\n" in rid:
            return self._refused(400, "not a replica id", "replica_id")
        try:
            changed = self.membership.deregister(rid)
        except MembershipRefused as e:
            return self._refused(e.status, e.message, e.param)
        self.membership.metrics.registrations.labels("deregistered").inc()
        if changed:
            await self._changed(f"replica {rid} deregistered")
        grace = self._cfg().membership.drain_grace_s
        return web.json_response({"replica_id": rid, "state": "draining" if rid in self.membership.members else "gone",
                                  "drain_grace_s": grace})
