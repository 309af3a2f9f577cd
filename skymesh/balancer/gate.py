"""What a request passes before the balancer's handlers see it: client API keys and
per-key limits on /v1/*, the admin token on /admin/*, /metrics access; then, and only
then, the body is read: within ``client_timeouts.body_timeout_s`` (slowloris) and
``policy.max_body_bytes``, inflated by the bounded decoder (skymesh/edge/body.py). The
bounds on the request head and on connections are the server's (skymesh/edge/server.py).

Peer balancers' forwarded requests carry no client key and arrive only on the peer
listener (peer_listener.py): there they are let through on the peer token (checked here,
before the body is read, by :func:`skymesh.security.admin_auth.peer_token_denied`), after the
listener checked the sender's certificate. The client port refuses any request
carrying the hop header.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler

from skymesh.balancer.auth import (
    ClientKey,
    ClientKeyring,
    invalid_key_response,
    missing_key_response,
)
from skymesh.balancer.ratelimit import TokenBucket, retry_after_header
from skymesh.config import ClientLimits, MeshConfig
from skymesh.edge.body import BodyLimits, read_body_or_reject
from skymesh.edge.openai_errors import error_response
from skymesh.security.admin_auth import admin_denied, bearer_of, metrics_denied, peer_token_denied

# request[CLIENT] is the authenticated ClientKey (None when the API is open or for peers)
CLIENT = web.RequestKey("skymesh.client", ClientKey | None)


@dataclass(slots=True)
class _Buckets:
    requests: TokenBucket | None
    prompt_tokens: TokenBucket | None


def _buckets(limits: ClientLimits) -> _Buckets:
    req = None
    if limits.requests_per_second is not None:
        burst = limits.request_burst or max(1.0, limits.requests_per_second)
        req = TokenBucket(rate=limits.requests_per_second, capacity=float(burst))
    tok = None
    if limits.prompt_tokens_per_minute is not None:
        tok = TokenBucket(rate=limits.prompt_tokens_per_minute / 60.0, capacity=float(limits.prompt_tokens_per_minute))
    return _Buckets(req, tok)


class ClientGate:
    def __init__(
        self,
        cfg: MeshConfig,
        admin_token: str | None,
        peer_token_header: str,
        hop_header: str,
        peer_token: str,
        on_reject: Callable[[int], None] = lambda status: None,
        keyring: ClientKeyring | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_refused_forward: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.cfg = cfg
        self.admin_token = admin_token
        self.keyring = keyring if keyring is not None else ClientKeyring.from_config(cfg.client_auth)
        self._peer_token_header = peer_token_header
        self._peer_token = peer_token
        self._hop_header = hop_header
        self._on_reject = on_reject
        self._on_refused_forward = on_refused_forward
        self._clock = clock
        # per key name; bounded by the configured keys
        self._buckets = {k.name: _buckets(k.limits) for k in self.keyring.keys}
        # per key name: (requests, prompt tokens) taken here since the siblings were last
        # told (limits hold across a region's balancers: take_usage / charge_siblings)
        self._usage: dict[str, tuple[float, float]] = {}

    def reconfigure(self, cfg: MeshConfig, keyring: ClientKeyring, admin_token: str | None) -> None:
        """A reloaded config: its keys, limits, admin token and metrics access apply to the
        next request. A key whose name and limits did not change keeps its token buckets
        (what it spent stays spent); a removed key is refused from now on."""
        old_limits = {k.name: k.limits for k in self.keyring.keys}
        self._buckets = {
            k.name: self._buckets[k.name] if old_limits.get(k.name) == k.limits else _buckets(k.limits)
            for k in keyring.keys
        }
        self.cfg, self.keyring, self.admin_token = cfg, keyring, admin_token

    # ------------------------------------------------------------------ checks

    def admit(self, request: web.BaseRequest, now: float) -> tuple[ClientKey | None, web.Response | None]:
        """Who the client is, or the 401/403/429 it gets (before its body is read)."""
        if self._hop_header in request.headers:
            # forwards come only over the peer listener (mTLS): here the peer token would
            # have crossed the network in clear, and nothing binds the origin it claims
            self._on_refused_forward("client_port")
            return None, error_response(
                403, "forwarded requests are accepted only on the peer listener (mTLS), not on the client port",
                code="forward_on_client_port",
            )
        if not self.keyring.enabled:
            return None, None
        presented_key = bearer_of(request)
        if presented_key is None:
            return None, missing_key_response()
        client = self.keyring.authenticate(presented_key)
        if client is None:
            return None, invalid_key_response()
        bucket = self._buckets[client.name].requests
        if bucket is not None and bucket.try_take(now):
            self._spent(client.name, 1.0, 0.0)
        elif bucket is not None:
            return client, error_response(
                429,
                f"Rate limit reached for requests of key {client.name!r}: "
                f"{client.limits.requests_per_second:g} requests per second.",
                code="rate_limit_exceeded",
                error_type="requests",
                headers={"Retry-After": retry_after_header(bucket.wait_s(now))},
            )
        return client, None

    def _spent(self, key_name: str, requests: float, prompt_tokens: float) -> None:
        r, t = self._usage.get(key_name, (0.0, 0.0))
        self._usage[key_name] = (r + requests, t + prompt_tokens)

    def take_usage(self) -> dict[str, tuple[float, float]]:
        """What each key took here since the last call: the siblings charge it too."""
        usage, self._usage = self._usage, {}
        return usage

    def charge_siblings(self, usage: Mapping[str, tuple[float, float]], now: float | None = None) -> None:
        """What a sibling balancer took of each key's limits: taken here too, so a key's
        budgets hold across the region's balancers (within what one message interval
        admits). Names of keys not configured here and values that are not finite and
        non-negative are ignored. ``now``: the gate's clock (default: read it)."""
        now = self._clock() if now is None else now
        for name, (requests, prompt_tokens) in usage.items():
            buckets = self._buckets.get(name)
            if buckets is None:
                continue
            if buckets.requests is not None and math.isfinite(requests) and requests > 0:
                buckets.requests.charge(now, requests)
            if buckets.prompt_tokens is not None and math.isfinite(prompt_tokens) and prompt_tokens > 0:
                buckets.prompt_tokens.charge(now, prompt_tokens)

    def charge_prompt(self, request: web.BaseRequest, prompt_tokens: int, now: float) -> web.Response | None:
        """Take a parsed request's prompt tokens from its key's bucket; the 429 when they
        are not there (nothing is taken then)."""
        client = request.get(CLIENT)
        if client is None:
            return None
        # a key removed by a reload after this request was admitted: it is let through
        buckets = self._buckets.get(client.name)
        bucket = buckets.prompt_tokens if buckets is not None else None
        if bucket is None:
            return None
        if bucket.try_take(now, prompt_tokens):
            self._spent(client.name, 0.0, float(prompt_tokens))
            return None
        wait = bucket.wait_s(now, prompt_tokens)
        limit = client.limits.prompt_tokens_per_minute
        self._on_reject(429)
        if wait == float("inf"):
            return error_response(
                429, f"The prompt ({prompt_tokens} tokens) exceeds key {client.name!r}'s limit of "
                f"{limit} prompt tokens per minute.", code="rate_limit_exceeded", error_type="tokens",
            )
        return error_response(
            429,
            f"Rate limit reached for prompt tokens of key {client.name!r}: {limit} per minute.",
            code="rate_limit_exceeded",
            error_type="tokens",
            headers={"Retry-After": retry_after_header(wait)},
        )

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith("/v1/"):
            client, denied = self.admit(request, self._clock())
            if denied is not None:
                self._on_reject(denied.status)
                if request.body_exists:
                    denied.force_close()  # its body is never read: the connection ends here
                return denied
            request[CLIENT] = client
            return await self._with_body(request, handler)
        elif path.startswith("/admin/"):
            denied = admin_denied(request, self.admin_token, self.cfg.admin.token_env)
            if denied is not None:
                return denied
        elif path == "/metrics":
            denied = metrics_denied(request, self.cfg, self.admin_token)
            if denied is not None:
                return denied
        return await handler(request)

    @web.middleware
    async def peer_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The peer listener's gate (after its certificate check, peer_listener.py): only
        forwarded /v1/ requests with the peer token, their body read within the bound."""
        if not request.path.startswith("/v1/") or self._hop_header not in request.headers:
            self._on_reject(404)
            return error_response(404, "the peer listener serves only forwarded /v1/ requests", code="not_found")
        denied = peer_token_denied(request.headers.get(self._peer_token_header), self._peer_token)
        if denied is not None:
            self._on_reject(denied.status)
            return denied
        request[CLIENT] = None
        return await self._with_body(request, handler)

    async def _with_body(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """``handler``'s answer once the body is read (the caller is known by now), or
        the answer when it cannot be read."""
        if request.body_exists:
            refused = await self._read_body(request)
            if refused is not None:
                return refused
        return await handler(request)

    async def _read_body(self, request: web.Request) -> web.Response | None:
        """Read the body within its timeout and size bound, decoding it with bounds
        (aiohttp keeps it, so the handler's ``request.read()`` returns it at once); the
        answer instead when it cannot be read (408, 413, 415, 400), the connection closed
        after it."""
        limits = BodyLimits(self.cfg.policy.max_body_bytes, self.cfg.client_timeouts.body_timeout_s)
        refused = await read_body_or_reject(request, limits)
        if refused is not None:
            self._on_reject(refused.status)
        return refused
