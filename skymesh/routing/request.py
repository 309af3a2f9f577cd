"""What the routing core knows of one request: :class:`RoutingRequest`.

Its own module so that the region model (``model.py``) and the policy types (``base.py``,
which re-exports it) both import it downward: ``base`` imports ``model`` (a
:class:`~skymesh.routing.base.PolicyContext` carries a region's model), never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RoutingRequest:
    """What the routing core knows of one request (computed once at admission)."""

    request_id: str
    # cumulative xxhash64 of the prompt's fixed-size token chunks: chunk_hashes[i] identifies
    # the prefix made of chunks 0..i (see skymesh.routing.hashing)
    chunk_hashes: tuple[int, ...]
    prompt_tokens: int
    arrival: float
    max_tokens: int = 16
    session_key: str | None = None  # X-Session-ID header or OpenAI `user`
    slo_ttft_s: float | None = None  # None: the balancer's configured SLO
    # its SLO class ("" for none) and that class's other targets and priority (higher is
    # placed first); the class's TTFT target is slo_ttft_s
    slo_class: str = ""
    slo_tpot_s: float | None = None
    slo_e2e_s: float | None = None
    priority: int = 0
    forwarded: bool = False  # arrived from a peer balancer (never forwarded again)
    # the region the client belongs to (its source network, or the forwarding balancer's
    # origin header); None: the balancer's own region. Residency rules are checked by it.
    origin_region: str | None = None
