"""How the balancers of one region talk to each other (``siblings:``): the interval of
their state messages and how many a sibling may miss before it counts as gone
(docs/routing.md, "A region is a fleet"). A region of one balancer sends none."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from skymesh.config.base import ConfigModel, Float, Int

# a balancer whose state did not change still sends it this often (in intervals;
# skymesh/balancer/sibling_link.py): a silence of miss_limit intervals spans two at least
KEEPALIVE_TICKS = 4


class SiblingsConfig(ConfigModel):
    # each balancer's state (push-budget units, loads, placements, key usage) this often,
    # when it changed (at least every KEEPALIVE_TICKS intervals)
    interval_s: Annotated[Float, Field(ge=0.005, le=5)] = 0.02
    # silent for this many intervals: gone (its units are claimed again without its word)
    miss_limit: Annotated[Int, Field(ge=2 * KEEPALIVE_TICKS + 1, le=100)] = 15

    @property
    def dead_after_s(self) -> float:
        return self.interval_s * self.miss_limit
