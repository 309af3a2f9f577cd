"""SLO classes at the balancer: which class a request belongs to.

A request names its class in the ``X-SLO-Class`` header; without one it takes its API
key's class, else the config's ``default_slo_class``; a name the config does not define is
a 400 (OpenAI-shaped), never a silent default. The class travels with a forwarded request
in the same header (the peer reads it against the same mesh config). Its TTFT target
binds routing (``RoutingRequest.slo_ttft_s``: the target DualMap, the ``slo`` and
``prefix`` queue disciplines and early rejection go by, and a class whose target the
link's round trip uses up is never offloaded); its priority orders the queue.

The balancer the client called judges the answer when it ends (:func:`skymesh.slo_judge.missed_targets`):
TTFT from arrival to the first byte of a stream (a non-streaming answer's first byte is its
last, so only its end-to-end time is judged), TPOT where the answer's usage reports
``completion_tokens`` (streams with ``stream_options.include_usage``, and every
non-streaming answer), end to end from arrival to the last byte.
"""

from __future__ import annotations

from skymesh.config import MeshConfig
from skymesh.edge.openai_errors import RequestError
from skymesh.slo_judge import SloClass

SLO_CLASS_HEADER = "X-SLO-Class"
# a header value echoed in an error is cut to this (it is the client's text)
_ECHO_CHARS = 40


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
