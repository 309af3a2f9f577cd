"""A split request's prefill leg, as vLLM 0.32's own disaggregated proxy sends it
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` in vLLM; the NIXL pull
connector's fields, ``kv_connector/v1/nixl/pull_scheduler.py``), and what it hands the
decode leg.

- :func:`prefill_body`: the client's body with ``kv_transfer_params``
  ``{"do_remote_decode": true, ...}``, ``stream`` false, ``max_tokens`` 1 (and
  ``max_completion_tokens`` 1 where the client named it), without ``stream_options``,
  ``min_tokens`` and ``min_completion_tokens`` (vLLM's proxy drops them: "not supported
  for P").
- :func:`prefill_leg`: sends it, non-streaming, within a deadline, reading at most
  ``MAX_PREFILL_ANSWER_BYTES`` of the answer, and returns the answer's top-level
  ``kv_transfer_params`` (None: the prefill answered none, as an aborted one does) or how
  it failed, in the words an attempt's failure is told to the region core.
- :func:`checked_params`: the parameters only when the endpoint they name is one of the
  region's replicas (never a host a replica's answer makes up).
- :func:`decode_body`: the client's own body with those parameters.

The decode leg itself is an ordinary attempt (skymesh/balancer/proxy.py) with that body.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from skymesh.balancer.proxy import OVERLOAD_STATUSES, AttemptTarget, UpstreamTimeouts, send

# the prefill leg's answer is one token's JSON: a bound far above it, far below harm
MAX_PREFILL_ANSWER_BYTES = 1 << 20
# what vLLM's proxy sends the prefill replica (its remote_* fields null)
PREFILL_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
# the fields a decode side needs to read the blocks (vLLM recomputes without any of them)
REQUIRED_DECODE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                          "remote_port")
_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(raw: bytes) -> bytes:
    """The prefill leg's body from the client's (already validated as a JSON object)."""
    body = json.loads(raw)
    body["kv_transfer_params"] = dict(PREFILL_REQUEST_PARAMS)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for key in _DROPPED_FOR_PREFILL:
        body.pop(key, None)
    return json.dumps(body, separators=(",", ":")).encode()


def decode_body(raw: bytes, params: dict[str, Any] | None) -> bytes:
    """The decode leg's body: the client's own, with the prefill's parameters (none: the
    decode replica runs the prefill itself)."""
    if not params:
        return raw
    body = json.loads(raw)
    body["kv_transfer_params"] = params
    return json.dumps(body, separators=(",", ":")).encode()


def replica_hosts(urls: Collection[str]) -> frozenset[str]:
    """The hosts of the region's replicas (their URLs), as an endpoint is checked."""
    return frozenset(h for u in urls if (h := urlsplit(u).hostname) is not None)


def checked_params(params: Any, hosts: frozenset[str]) -> dict[str, Any] | None:
    """``params`` when they are an object naming every field a decode side needs, with
    ``remote_host`` one of the region's replica hosts and a port in range; else None (the
    decode replica then runs the prefill itself, as vLLM's does with invalid parameters)."""
    if not isinstance(params, dict) or any(params.get(k) is None for k in REQUIRED_DECODE_FIELDS):
        return None
    host, port = params["remote_host"], params["remote_port"]
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        pass  # a name: compared as it is
    return params if host in hosts else None


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prefill leg's end: ``ok`` with the parameters it answered (None: none), or how it
    failed, in the terms of an attempt's failure (skymesh/balancer/proxy.py)."""

    ok: bool
    params: dict[str, Any] | None = None
    reason: str = ""
    counts_against_health: bool = True


async def prefill_leg(target: AttemptTarget, raw: bytes, timeouts: UpstreamTimeouts,
                      deadline_s: float) -> PrefillResult:
    """Send the prefill leg (``raw``: the client's body) and read its answer's parameters."""
    body = prefill_body(raw)
    try:
        async with asyncio.timeout(deadline_s):
            upstream = await send(target, body, timeouts)
            try:
                answer = await _read_bounded(upstream)
                status = upstream.status
            finally:
                upstream.release()
    except TimeoutError:
        return PrefillResult(False, reason="prefill: no answer in time")
    except (aiohttp.ClientError, OSError) as e:
        return PrefillResult(False, reason=f"prefill: {type(e).__name__}")
    if answer is None:
        return PrefillResult(False, reason="prefill: answer over its bound")
    if status != 200:
        return PrefillResult(False, reason=f"prefill: HTTP {status}", counts_against_health=status not in OVERLOAD_STATUSES)
    try:
        params = json.loads(answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return PrefillResult(False, reason="prefill: answer is not a JSON object")
    return PrefillResult(True, params if isinstance(params, dict) else None)


async def _read_bounded(upstream: Any) -> bytes | None:
    """The whole answer, or None past ``MAX_PREFILL_ANSWER_BYTES``."""
    out = bytearray()
    while True:
        chunk = await upstream.content.readany()
        if not chunk:
            return bytes(out)
        out += chunk
        if len(out) > MAX_PREFILL_ANSWER_BYTES:
            return None
