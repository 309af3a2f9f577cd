"""vLLM's Prometheus metrics, rendered byte-for-byte the way vLLM's scrape looks.

vLLM (``vllm/v1/metrics/loggers.py``) registers its metrics with ``prometheus_client``
under label names ``model_name`` and ``engine``; ``prometheus_client`` renders a sample's
labels *sorted by name*, so a real scrape reads ``{engine="0",model_name="m"}``,
``{engine="0",finished_reason="length",model_name="m"}`` and
``{engine="0",le="0.5",model_name="m"}``. Counters and histograms also carry a
``<name>_created`` gauge (the Unix time the series was created), as prometheus_client emits
by default. This module renders that format without depending on prometheus_client.

Engine gauges and token counters are read from the engine at scrape time, so the request
path only touches the histograms.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence

from skymesh.replica_sim.engine import Engine

# bucket boundaries of vLLM v1 (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# vLLM's FinishReason values; every one is pre-created at 0 like vLLM does
FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exp += 1


def go_float(v: float) -> str:
    """A float the way prometheus_client writes it (Go's strconv conventions)."""
    if v == float("inf"):
        return "+Inf"
    if v == float("-inf"):
        return "-Inf"
    if v != v:
        return "NaN"
    s = repr(float(v))
    dot = s.find(".")
    if v > 0 and dot > 6:  # large numbers in exponent form, as prometheus_client does
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    items = sorted(pairs)
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in items) + "}"


def _esc_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


class _Family:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str], created: float) -> None:
        self.name = name  # without the counter's _total suffix
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self.created = created

    def _head(self, name: str, kind: str) -> list[str]:
        return [f"# HELP {name} {_esc_help(self.help)}", f"# TYPE {name} {kind}"]

    def _created_block(self, label_sets: Iterable[tuple[str, ...]]) -> list[str]:
        lines = self._head(self.name + "_created", "gauge")
        for lv in label_sets:
            lines.append(f"{self.name}_created{_labels(zip(self.labelnames, lv, strict=True))} "
                         f"{go_float(self.created)}")
        return lines

    def render(self) -> list[str]:
        raise NotImplementedError


class GaugeFn(_Family):
    """A gauge read from a callback at scrape time."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str], created: float,
                 label_values: tuple[str, ...], read: Callable[[], float]) -> None:
        super().__init__(name, help_text, labelnames, created)
        self.label_values = label_values
        self.read = read

    def render(self) -> list[str]:
        lines = self._head(self.name, "gauge")
        lines.append(f"{self.name}{_labels(zip(self.labelnames, self.label_values, strict=True))} "
                     f"{go_float(float(self.read()))}")
        return lines


class CounterFn(_Family):
    """A counter whose per-label-set values are read from callbacks at scrape time."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str], created: float,
                 series: dict[tuple[str, ...], Callable[[], float]]) -> None:
        super().__init__(name, help_text, labelnames, created)
        self.series = series

    def render(self) -> list[str]:
        total = self.name + "_total"
        lines = self._head(total, "counter")
        for lv, read in self.series.items():
            lines.append(f"{total}{_labels(zip(self.labelnames, lv, strict=True))} {go_float(float(read()))}")
        lines += self._created_block(self.series)
        return lines


class Counter(_Family):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str], created: float,
                 initial: Iterable[tuple[str, ...]] = ()) -> None:
        super().__init__(name, help_text, labelnames, created)
        self.values: dict[tuple[str, ...], float] = {lv: 0.0 for lv in initial}

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        self.values[label_values] = self.values.get(label_values, 0.0) + amount

    def get(self, *label_values: str) -> float:
        return self.values.get(label_values, 0.0)

    def render(self) -> list[str]:
        total = self.name + "_total"
        lines = self._head(total, "counter")
        for lv, v in self.values.items():
            lines.append(f"{total}{_labels(zip(self.labelnames, lv, strict=True))} {go_float(v)}")
        lines += self._created_block(self.values)
        return lines


class Histogram(_Family):
    """A histogram with one fixed label set (all of the stand-in's have one)."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str], created: float,
                 label_values: tuple[str, ...], buckets: Sequence[float]) -> None:
        super().__init__(name, help_text, labelnames, created)
        self.label_values = label_values
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # buckets are "<= le": bisect_left puts a value equal to a bound in that bucket
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        base = list(zip(self.labelnames, self.label_values, strict=True))
        lines = self._head(self.name, "histogram")
        acc = 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            lines.append(f"{self.name}_bucket{_labels([*base, ('le', go_float(bound))])} {go_float(acc)}")
        lines.append(f"{self.name}_count{_labels(base)} {go_float(self.count)}")
        lines.append(f"{self.name}_sum{_labels(base)} {go_float(self.sum)}")
        lines += self._created_block([self.label_values])
        return lines


class ReplicaMetrics:
    """The vLLM metric set of one stand-in replica (engine index 0)."""

    def __init__(self, engine: Engine, model_name: str, max_model_len: int,
                 created: float | None = None) -> None:
        created = time.time() if created is None else created
        ln = ("model_name", "engine")
        lv = (model_name, "0")
        e = engine

        def counter(name: str, help_text: str, read: Callable[[], float]) -> CounterFn:
            return CounterFn(name, help_text, ln, created, {lv: read})

        def hist(name: str, help_text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, help_text, ln, created, lv, buckets)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            (*ln, "finished_reason"), created, [(*lv, r) for r in FINISH_REASONS],
        )
        self._lv = lv
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                  token_buckets)
        self.generation_tokens = hist("vllm:request_generation_tokens",
                                      "Number of generation tokens processed.", token_buckets)
        self.families: list[_Family] = [
            GaugeFn("vllm:num_requests_running", "Number of requests in model execution batches.", ln,
                    created, lv, lambda: e.num_running),
            GaugeFn("vllm:num_requests_waiting", "Number of requests waiting to be processed.", ln,
                    created, lv, lambda: e.num_waiting),
            GaugeFn("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", ln,
                    created, lv, lambda: e.kv_cache_usage),
            counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                    lambda: e.prefix_cache_queries),
            counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                    lambda: e.prefix_cache_hits),
            counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                    lambda: e.num_preemptions),
            counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lambda: e.prompt_tokens_total),
            counter("vllm:generation_tokens", "Number of generation tokens processed.",
                    lambda: e.generation_tokens_total),
            self.request_success,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.prefill_time,
            self.decode_time,
        ]
        # not a vLLM metric: the stand-in's own supervision counter, a family of its own
        # after vLLM's so the vLLM lines above are unchanged
        self.loop_restarts = Counter("skymesh_loop_restarts", "Background loops restarted after an exception.",
                                     ("loop",), created, [("engine",)])
        self.families.append(self.loop_restarts)

    def finished(self, reason: str, e2e_s: float, queue_s: float, prefill_s: float, decode_s: float,
                 prompt_tokens: int, generation_tokens: int) -> None:
        self.request_success.inc(*self._lv, reason)
        if reason == "abort":
            return  # vLLM records latency histograms only for completed requests
        self.e2e.observe(e2e_s)
        self.queue_time.observe(queue_s)
        self.prefill_time.observe(prefill_s)
        self.decode_time.observe(decode_s)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)

    def render(self) -> str:
        lines: list[str] = []
        for f in self.families:
            lines += f.render()
        return "\n".join(lines) + "\n"
