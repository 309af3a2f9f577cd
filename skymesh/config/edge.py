"""Bounds every skymesh HTTP server puts on clients (skymesh/edge/server.py): how slow a
request may arrive and how many connections it keeps, so a flood costs bounded memory."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from skymesh.config.base import ConfigModel, Float, Int


class ClientTimeoutsConfig(ConfigModel):
    """Bounds on slow clients (slowloris) at every skymesh HTTP server."""

    # from connect (or the end of the previous response) to a complete request head
    header_timeout_s: Annotated[Float, Field(gt=0, le=3600)] = 10.0
    # from the request head to the whole body
    body_timeout_s: Annotated[Float, Field(gt=0, le=3600)] = 30.0


class HttpLimitsConfig(ConfigModel):
    """Bounds on connections at every skymesh HTTP server (balancer, controller, DNS
    control API): memory under a flood is bounded by these, not by the attacker
    (skymesh/edge/server.py)."""

    # open connections in all, and from one source address; over either: 503 and close
    max_connections: Annotated[Int, Field(ge=1, le=1_000_000)] = 4096
    max_connections_per_source: Annotated[Int, Field(ge=1, le=1_000_000)] = 1024
    # bytes of one incomplete request head (request line and header fields); over: 431
    max_head_bytes: Annotated[Int, Field(ge=1024, le=16 * 1024 * 1024)] = 64 * 1024
