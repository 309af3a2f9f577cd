"""A small Prometheus text-format registry (counters, gauges, histograms with labels).

Kept in-house so the hot path is a dict increment, and the exposition matches what
prometheus_client renders (# HELP / # TYPE, _bucket/_sum/_count, le="+Inf").
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence

LabelValues = tuple[str, ...]


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_esc(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if float(v).is_integer():
        return f"{float(v):.1f}"
    return repr(float(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[LabelValues, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> Iterable[str]:
        yield from self.header()
        base = self.name[:-6] if self.name.endswith("_total") else self.name
        for lv, v in self.values.items():
            yield f"{base}_total{_labels(self.labelnames, lv)} {_fmt(v)}"


class Gauge(_Metric):
    """A gauge whose values are read at scrape time from a callback (no bookkeeping on
    the hot path) or set explicitly."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        collect: Callable[[], Iterable[tuple[LabelValues, float]]] | None = None,
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[LabelValues, float] = {}
        self.collect = collect

    def set(self, *labels: str, value: float) -> None:
        self.values[labels] = value

    def render(self) -> Iterable[str]:
        yield from self.header()
        items = self.collect() if self.collect else self.values.items()
        for lv, v in items:
            yield f"{self.name}{_labels(self.labelnames, lv)} {_fmt(v)}"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, buckets: Sequence[float], labelnames: Sequence[str] = ()
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self.buckets = tuple(sorted(buckets))
        self.series: dict[LabelValues, list[float]] = {}  # bucket counts..., sum, count

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0.0] * (len(self.buckets) + 2)
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[i] += 1
        s[-2] += value
        s[-1] += 1

    def render(self) -> Iterable[str]:
        yield from self.header()
        for lv, s in self.series.items():
            cum = 0.0
            for b, c in zip(self.buckets, s, strict=False):
                cum += c
                le = 'le="' + _fmt(b) + '"'
                yield f"{self.name}_bucket{_labels(self.labelnames, lv, le)} {_fmt(cum)}"
            inf = 'le="+Inf"'
            yield f"{self.name}_bucket{_labels(self.labelnames, lv, inf)} {_fmt(s[-1])}"
            yield f"{self.name}_sum{_labels(self.labelnames, lv)} {_fmt(s[-2])}"
            yield f"{self.name}_count{_labels(self.labelnames, lv)} {_fmt(s[-1])}"


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines.extend(m.render())  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"


def parse_samples(text: str, wanted: Iterable[str]) -> dict[str, float]:
    """Sum of the samples of each wanted metric name in a Prometheus text page.

    A fast line scan (no regex per line): the prober runs this every 100 ms per replica.
    """
    want = set(wanted)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        name = line[:end] if end >= 0 else line
        if name not in want:
            continue
        value_s = line.rsplit(" ", 1)[-1]
        try:
            out[name] = out.get(name, 0.0) + float(value_s)
        except ValueError:
            continue
    return out
