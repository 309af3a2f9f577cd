"""The admin credential shared by the balancer's /admin/*, the controller's HTTP API, the
DNS control API and `skymesh status`: one bearer token, compared in constant time. The
peer token balancers and the controller present to each other is resolved and checked
here too (:func:`peer_token_denied`).

Where the token comes from (``admin:`` in the config), first found wins: the environment
variable ``admin.token_env`` (``SKYMESH_ADMIN_TOKEN``), the file ``admin.token_file``, then
the local-mode file ``<state dir>/admin-token`` that ``skymesh up`` creates (and passes to
its children in the environment). With no token anywhere the admin surfaces answer 401:
they fail closed rather than open.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from skymesh.config import MeshConfig
from skymesh.edge.openai_errors import error_response
from skymesh.security.pki import is_loopback_host

DEFAULT_STATE_DIR = Path(".skymesh/run")
LOCAL_TOKEN_FILE = "admin-token"
LOCAL_PEER_TOKEN_FILE = "peer-token"
PEER_TOKEN_ENV = "SKYMESH_PEER_TOKEN"
DEFAULT_TOKEN_ENV = "SKYMESH_ADMIN_TOKEN"  # admin.token_env's default


def _read_token(path: Path) -> str | None:
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return token or None


def token_from(env_var: str, token_file: str | None) -> str | None:
    """A secret from the environment variable ``env_var``, else from ``token_file``."""
    token = os.environ.get(env_var, "").strip()
    if token:
        return token
    if token_file is not None:
        return _read_token(Path(token_file).expanduser())
    return None


def resolve_admin_token(cfg: MeshConfig, state_dir: Path | None = DEFAULT_STATE_DIR) -> str | None:
    """The admin token from the env var, the configured file, or the local state dir."""
    token = token_from(cfg.admin.token_env, cfg.admin.token_file)
    if token:
        return token
    if state_dir is not None:
        return _read_token(Path(state_dir) / LOCAL_TOKEN_FILE)
    return None


def ensure_local_token(state_dir: Path, name: str = LOCAL_TOKEN_FILE) -> str:
    """A local mesh's token: read from ``state_dir/name``, created (0600, random) the first
    time, so `skymesh status` finds the admin token `skymesh up` uses and processes started
    by hand from the same directory share one peer token."""
    path = Path(state_dir) / name
    existing = _read_token(path)
    if existing:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # created with 0600 from the start: never readable by others, not even briefly
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


class MissingSecretError(Exception):
    """A component would serve beyond loopback with no configured secret."""


def resolve_peer_token(
    cfg: MeshConfig, listen_hosts: tuple[str, ...], state_dir: Path | None = DEFAULT_STATE_DIR
) -> str:
    """The mesh's peer token (forwarded requests between balancers, the DNS control API):
    ``$SKYMESH_PEER_TOKEN``, then ``peer_token`` in the config, then the local-mode file
    ``<state dir>/peer-token``. Never a value shipped in the code: with none configured, a
    component listening only on loopback creates the local file (the processes of one
    local mesh share it); one listening beyond loopback refuses to start."""
    token = os.environ.get(PEER_TOKEN_ENV, "").strip() or cfg.peer_token
    if token:
        return token
    if state_dir is not None:
        found = _read_token(Path(state_dir) / LOCAL_PEER_TOKEN_FILE)
        if found:
            return found
        if all(is_loopback_host(h) for h in listen_hosts):
            return ensure_local_token(Path(state_dir), LOCAL_PEER_TOKEN_FILE)
    raise MissingSecretError(
        f"no peer token: set {PEER_TOKEN_ENV} or peer_token in the config to one long random "
        "string shared by the mesh's balancers, DNS server and controller"
    )


def admin_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def bearer_of(request: web.BaseRequest) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def token_matches(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison; no expected token never matches."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


def is_loopback_peer(request: web.BaseRequest) -> bool:
    remote = request.remote
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def how_to_authenticate(token_env: str = DEFAULT_TOKEN_ENV) -> str:
    """Where an admin finds the token and how to send it: names only, never the token."""
    return (f"send the header 'Authorization: Bearer <admin token>'; the token is the server's ${token_env}, "
            "or the file admin.token_file names in the mesh config, or, for a mesh `skymesh up` started, "
            f"{DEFAULT_STATE_DIR / LOCAL_TOKEN_FILE} (<--state-dir>/{LOCAL_TOKEN_FILE}) in the directory it was "
            "started from (`skymesh status` reads it there)")


def admin_denied(request: web.BaseRequest, expected: str | None,
                 token_env: str = DEFAULT_TOKEN_ENV) -> web.Response | None:
    """None when the request carries the admin token, else the 401 to answer, saying how
    to authenticate (``token_env``: the config's ``admin.token_env``)."""
    if token_matches(bearer_of(request), expected):
        return None
    message = (
        f"this endpoint needs the admin token: {how_to_authenticate(token_env)}"
        if expected
        else f"no admin token is configured here: set ${token_env} or admin.token_file for this server"
    )
    return error_response(401, message, code="invalid_admin_token",
                          headers={"WWW-Authenticate": 'Bearer realm="skymesh-admin"'})


def peer_token_denied(presented: str | None, expected: str) -> web.Response | None:
    """None when ``presented`` is the mesh's peer token (compared in constant time), else
    the 401 to answer, the connection closed after it (the body is never read). The one
    check of the peer token: the peer listener's forwards (its ``X-Skymesh-Peer-Token``
    header) and the DNS control API's endpoint pushes (a bearer token)."""
    if token_matches(presented, expected):
        return None
    response = error_response(401, "request without a valid peer token", code="invalid_peer_token")
    response.force_close()
    return response


def metrics_denied(request: web.BaseRequest, cfg: MeshConfig, expected: str | None) -> web.Response | None:
    """/metrics access by ``admin.metrics_access``: open, loopback clients only, or token."""
    mode = cfg.admin.metrics_access
    if mode == "open" or (mode == "loopback" and is_loopback_peer(request)):
        return None
    return admin_denied(request, expected, cfg.admin.token_env)


def admin_middleware(
    expected: Callable[[], str | None], prefixes: tuple[str, ...], cfg: Callable[[], MeshConfig] | None = None
) -> Middleware:
    """An aiohttp middleware that guards the paths under ``prefixes`` with the admin token
    (and /metrics by ``admin.metrics_access`` when ``cfg`` is given). Both are read on
    every request, so a config reload changes them. /health stays open: it is what
    liveness checks and `skymesh up` poll."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        denied: web.Response | None = None
        if path == "/metrics" and cfg is not None:
            denied = metrics_denied(request, cfg(), expected())
        elif path.startswith(prefixes):
            denied = admin_denied(request, expected(), cfg().admin.token_env if cfg is not None else DEFAULT_TOKEN_ENV)
        if denied is not None:
            return denied
        return await handler(request)

    return guard
