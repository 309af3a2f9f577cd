"""The balancer's peer listener: where peer balancers' forwarded requests arrive, and only
there (the client port refuses a request carrying the hop header, see gate.py).

With the mesh's ``tls`` section it is HTTPS under the mesh CA with client certificates
(:func:`skymesh.security.pki.peer_tls`): a caller without a certificate from the mesh CA fails the
handshake, and one whose certificate names no peer balancer is refused 403. The origin
region a forward claims (``X-Skymesh-Origin-Region``, which decides the residency rules
the request is held to) is bound to the certificate: it must be the sender's own region,
or a region whose replicas the controller gave the sender (adopted on failover). The
peer token is still checked after that (gate.py), but never travels in clear.

Without ``tls`` (a mesh on loopback only, like gRPC without credentials) the listener is
plain HTTP and must bind loopback; origins are then only checked against the configured
regions (server.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from skymesh.config import HostPort
from skymesh.edge.openai_errors import error_response
from skymesh.security.pki import (
    PeerTls,
    identity_of_peercert,
    region_of_identity,
    require_credentials_off_loopback,
)

# the region of the verified certificate a forward came with (set by the middleware)
PEER_REGION = web.RequestKey("skymesh.peer_region", str)


def peer_region_of(request: web.BaseRequest) -> str | None:
    """The region named by the verified client certificate of ``request``'s TLS
    connection; None without TLS or without a balancer certificate."""
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if ssl_object is None:
        return None
    return region_of_identity(identity_of_peercert(ssl_object.getpeercert()))


def make_binding_middleware(
    *,
    tls: bool,
    peers: Callable[[], frozenset[str]],
    allowed_origins: Callable[[str], frozenset[str]],
    origin_header: str,
    on_refused: Callable[[str], None],
) -> Any:
    """The peer app's first check: with ``tls``, the caller must hold a peer balancer's
    certificate (``peers()``: the regions that are peers now) and the origin it claims
    must be one ``allowed_origins(its region)`` holds. ``on_refused(reason)`` counts a
    refusal ("not_a_peer", "wrong_origin")."""

    @web.middleware
    async def bind_origin(request: web.Request, handler: Handler) -> web.StreamResponse:
        if tls:
            region = peer_region_of(request)
            if region is None or region not in peers():
                on_refused("not_a_peer")
                return error_response(403, "only peer balancers may forward requests", code="not_a_peer")
            claimed = request.headers.get(origin_header, "")
            if claimed not in allowed_origins(region):
                on_refused("wrong_origin")
                return error_response(
                    403, f"a forward from {region} may not claim origin region {claimed[:64]!r}",
                    code="origin_not_bound_to_certificate")
            request[PEER_REGION] = region
        return await handler(request)

    return bind_origin


async def start_peer_site(runner: web.BaseRunner, listen: HostPort, tls: PeerTls | None,
                          what: str) -> web.TCPSite:
    """Listen on ``listen`` (port 0: any free one) for the peer app ``runner`` serves:
    HTTPS with a client certificate required when ``tls`` is given, else plain HTTP,
    which only loopback may have (a ConfigError otherwise)."""
    require_credentials_off_loopback(listen.host, tls, what, "the peer listener")
    site = web.TCPSite(runner, listen.host, listen.port, reuse_address=True,
                       ssl_context=None if tls is None else tls.server)
    await site.start()
    return site
