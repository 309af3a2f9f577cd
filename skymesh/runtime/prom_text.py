"""The probe side of the Prometheus text format: a fast reader of a few samples.

The /metrics pages themselves are rendered by prometheus_client (skymesh.balancer.metrics,
skymesh.replica_sim.vllm_metrics); this parser stays hand-written because the prober runs it on
every replica's page every 100 ms and wants a handful of names, not a full parse. Real
vLLM 0.32's page is ~50 KB (~370 ``vllm:`` series, HTTP and process metrics besides):
the reader looks for the wanted names (``str.find``) instead of splitting every line.
"""

from __future__ import annotations

from collections.abc import Iterable


def parse_samples(text: str, wanted: Iterable[str]) -> dict[str, float]:
    """Sum of the samples of each wanted metric name in a Prometheus text page.

    A sample whose value is not a number is skipped; NaN and ±Inf are numbers here and are
    returned as they are (the caller decides what they mean). A trailing timestamp is ignored.
    """
    return {name: total for name, (total, _) in parse_sample_counts(text, wanted).items()}


def parse_sample_counts(text: str, wanted: Iterable[str]) -> dict[str, tuple[float, int]]:
    """(sum, number of series) of each wanted metric name that has a numeric sample.

    vLLM labels every series with its engine (``engine="0"``); a server running several
    engines (data parallel) has one series per engine, whose sum is right for counts and
    counters and whose mean is right for fractions such as the KV-cache usage.
    """
    out: dict[str, tuple[float, int]] = {}
    for name in set(wanted):
        n = len(name)
        pos = text.find(name)
        while pos >= 0:
            after = pos + n
            # a sample line starts with the name, followed by its labels or its value
            # (not a longer name such as vllm:num_requests_waiting_by_reason, not a comment)
            if (pos == 0 or text[pos - 1] == "\n") and text[after : after + 1] in ("{", " "):
                end = text.find("\n", after)
                line = text[after : end if end >= 0 else len(text)]
                value = _value(line)
                if value is not None:
                    total, count = out.get(name, (0.0, 0))
                    out[name] = (total + value, count + 1)
            pos = text.find(name, after)
    return out


def _value(rest: str) -> float | None:
    """The sample value of a line's remainder after its name (labels, value, timestamp)."""
    if rest[:1] == "{":
        # rfind: a label value may hold a space or a "}", the value and the timestamp never do
        close = rest.rfind("}")
        if close < 0:
            return None
        rest = rest[close + 1 :]
    fields = rest.split()
    if not fields:
        return None
    try:
        return float(fields[0])
    except ValueError:
        return None
