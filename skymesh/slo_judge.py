"""SLO classes, as the balancer and the simulator both use them: stamping a class on a
routing request, and judging a finished request against its class's targets.

TTFT is judged where a first-token time exists (a stream); TPOT from the first token to
the end over the output tokens after the first, where the output length is known; end to
end from arrival to the last token. A target that cannot be judged counts as neither met
nor missed.
"""

from __future__ import annotations

from dataclasses import dataclass

from skymesh.config import SloClassConfig
from skymesh.routing.base import RoutingRequest


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    targets: SloClassConfig


def apply_slo_class(req: RoutingRequest, slo: SloClass | None) -> None:
    """Stamp the class on the routing request. A class with no TTFT target of its own is
    bounded by its end-to-end target (the first token cannot come later than the last)."""
    if slo is None:
        return
    t = slo.targets
    req.slo_class = slo.name
    req.slo_ttft_s = t.ttft_s if t.ttft_s is not None else t.e2e_s
    req.slo_tpot_s = t.tpot_s
    req.slo_e2e_s = t.e2e_s
    req.priority = t.priority


def missed_targets(
    targets: SloClassConfig, *, e2e_s: float, ttft_s: float | None, completion_tokens: int | None
) -> list[str]:
    """The targets (``ttft``, ``tpot``, ``e2e``) the answer missed; those it cannot be
    judged on (no stream, no usage) count as neither met nor missed."""
    missed = []
    if targets.ttft_s is not None and ttft_s is not None and ttft_s > targets.ttft_s:
        missed.append("ttft")
    if targets.tpot_s is not None and ttft_s is not None and completion_tokens is not None and completion_tokens > 1:
        if (e2e_s - ttft_s) / (completion_tokens - 1) > targets.tpot_s:
            missed.append("tpot")
    if targets.e2e_s is not None and e2e_s > targets.e2e_s:
        missed.append("e2e")
    return missed
