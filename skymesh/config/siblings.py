"""How the balancers of one region talk to each other (``siblings:``): how soon a move of
the push-budget protocol goes out, how often a quiet balancer still speaks, and how many
keepalives a sibling may miss before it counts as gone
(docs/routing.md, "A region is a fleet"). A region of one balancer sends none."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from skymesh.config.base import ConfigError, ConfigModel, Float, Int


class SiblingsConfig(ConfigModel):
    # a move of the push-budget protocol (units, lends, wants, a claim and its answers)
    # reaches the siblings at most this late; looked for after dispatch rounds, never more
    # often than this (skymesh/balancer/sibling_link.py)
    interval_s: Annotated[Float, Field(ge=0.005, le=5)] = 0.02
    # a balancer with nothing new still sends its state this often (placements, key usage
    # and loads gathered since ride along): what says it is alive
    keepalive_s: Annotated[Float, Field(ge=0.005, le=30)] = 0.25
    # silent for this many keepalives: gone (its loads and queue no longer count; its units
    # stay its own until the topology drops it); at least 2, so one lost or late keepalive
    # never kills a live sibling
    miss_limit: Annotated[Int, Field(ge=2, le=100)] = 4
    # a push shows on the replica's metrics page (running or waiting) within this long:
    # the proxy's send, the server's tokenizing, one engine step. A balancer of several
    # counts its push as seen by a probe sent this long after it (its unit comes back
    # then, not only at the first token): too short lets the region push past the
    # replica's budget while a step hides its queue; too long holds units longer
    page_lag_s: Annotated[Float, Field(ge=0, le=30)] = 0.25
    # a unit's home lends it for this long per message (renewed in every message while the
    # borrower uses it): how long a stalled or dead balancer's borrowed units stay out of
    # use. At least 2 keepalives, so one lost message never ends a lease in use
    lease_s: Annotated[Float, Field(ge=0.01, le=60)] = 1.0
    # the most two balancers' wall clocks may differ: a home uses a lent unit again only
    # this long after the lease it gave ends by its own clock
    clock_skew_s: Annotated[Float, Field(ge=0, le=10)] = 0.25

    @model_validator(mode="after")
    def _keepalive_not_before_interval(self) -> SiblingsConfig:
        if self.keepalive_s < self.interval_s:
            raise ConfigError("keepalive_s", f"must be at least interval_s ({self.interval_s})")
        if self.lease_s < 2 * self.keepalive_s:
            raise ConfigError("lease_s", f"must be at least two keepalives ({2 * self.keepalive_s})")
        return self

    @property
    def dead_after_s(self) -> float:
        return self.keepalive_s * self.miss_limit
