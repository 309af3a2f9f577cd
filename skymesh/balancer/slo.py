"""SLO classes at the balancer: which class a request belongs to, and whether it met it.

A request names its class in the ``X-SLO-Class`` header; without one it takes its API
key's class, else the config's ``default_slo_class``; a name the config does not define is
a 400 (OpenAI-shaped), never a silent default. The class travels with a forwarded request
in the same header (the peer reads it against the same mesh config). Its TTFT target
binds routing (``RoutingRequest.slo_ttft_s``: DualMap's wait bound, and a class whose
target the link's round trip uses up is never offloaded); its priority orders the queue.

Judging, by the balancer the client called, when the answer ends: TTFT from arrival to
the first byte of a stream (a non-streaming answer's first byte is its last, so only its
end-to-end time is judged); TPOT from the first byte to the end over the output tokens
after the first, when the answer's usage reports ``completion_tokens`` (streams with
``stream_options.include_usage``, and every non-streaming answer); end to end from
arrival to the last byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from skymesh.balancer.errors import RequestError
from skymesh.config import MeshConfig, SloClassConfig
from skymesh.routing.base import RoutingRequest

SLO_CLASS_HEADER = "X-SLO-Class"
# a header value echoed in an error is cut to this (it is the client's text)
_ECHO_CHARS = 40



@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    targets: SloClassConfig


def resolve_slo_class(cfg: MeshConfig, header: str | None, key_class: str | None) -> SloClass | None:
    """The request's class (None: no class applies), or a 400 :class:`RequestError`."""
    classes = cfg.slo_classes
    if header is not None:
        name = header.strip()
        targets = classes.get(name)
        if targets is None:
            shown = name if len(name) <= _ECHO_CHARS else name[:_ECHO_CHARS] + "..."
            known = ", ".join(sorted(classes)) or "none are configured"
            raise RequestError(400, f"unknown SLO class {shown!r} in {SLO_CLASS_HEADER} (known: {known})",
                               code="invalid_slo_class")
        return SloClass(name, targets)
    # a key's class always exists in the config its keyring was built from; one removed by
    # a reload while the request was in the gate falls back to the default
    for name in (key_class, cfg.default_slo_class):
        if name is not None and name in classes:
            return SloClass(name, classes[name])
    return None


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
