"""The probe side of the Prometheus text format: a fast reader of a few samples.

The /metrics pages themselves are rendered by prometheus_client (skymesh.balancer.metrics,
skymesh.replica_sim.metrics); this parser stays hand-written because the prober runs it on
every replica's page every 100 ms and wants a handful of names, not a full parse.
"""

from __future__ import annotations

from collections.abc import Iterable


def parse_samples(text: str, wanted: Iterable[str]) -> dict[str, float]:
    """Sum of the samples of each wanted metric name in a Prometheus text page.

    A fast line scan (no regex per line): the prober runs this every 100 ms per replica.
    A sample whose value is not a number is skipped; NaN and ±Inf are numbers here and are
    returned as they are (the caller decides what they mean). A trailing timestamp is ignored.
    """
    want = set(wanted)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        if end < 0:
            continue  # a bare name, no value
        name = line[:end]
        if name not in want:
            continue
        # the value is the first field after the labels; rfind because a label value may
        # hold a space or a "}", the value and the timestamp never do
        fields = (line[line.rfind("}") + 1 :] if end == brace else line[end:]).split()
        if not fields:
            continue
        try:
            out[name] = out.get(name, 0.0) + float(fields[0])
        except ValueError:
            continue
    return out
