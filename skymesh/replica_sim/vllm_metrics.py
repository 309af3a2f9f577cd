"""vLLM's Prometheus metrics, rendered with prometheus_client exactly as vLLM renders them.

vLLM (``vllm/v1/metrics/loggers.py``) registers its metrics with ``prometheus_client``
under label names ``model_name`` and ``engine``; prometheus_client renders a sample's
labels *sorted by name*, so a scrape reads ``{engine="0",model_name="m"}``,
``{engine="0",finished_reason="length",model_name="m"}`` and
``{engine="0",le="0.5",model_name="m"}``. Counters and histograms also carry a
``<name>_created`` gauge (the Unix time the series was created): prometheus_client emits
it by default and vLLM does not turn it off, so neither does the stand-in (the balancer
drops its own ``_created`` samples per registry, never through the process-wide switch).

Engine gauges and token counters are read from the engine at scrape time by a custom
collector, so the request path only touches the histograms and the finish-reason counter.

``vllm:cache_config_info`` is vLLM's info-style gauge (``log_metrics_info`` in
``vllm/v1/metrics/loggers.py``): constant 1, one label per field of vLLM's ``CacheConfig``
(``metrics_info()``: every field of its ``__dict__``, as ``str()``) plus ``engine``, and no
``model_name``; vLLM registers it once the engine is up, after its other metrics.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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
LABEL_NAMES = ("model_name", "engine")
ENGINE_INDEX = "0"  # the stand-in is one engine, vLLM's engine index 0


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


def vllm_cache_config_info(*, num_gpu_blocks: int, block_size: int, max_model_len: int,
                           gpu_memory_utilization: float, num_gpu_blocks_override: int | None = None,
                           user_specified_block_size: bool = False) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` as vLLM 0.32's API server exposes them for
    a full-attention model (Llama, Qwen2.5) with default cache flags: ``CacheConfig``'s
    fields in declaration order (``vllm/config/cache.py``), each ``str()``'d. The front
    end's copy holds what the engine core reported back (``core_client.py``
    ``_apply_ready_response``: blocks, block size, KV capacity in tokens and concurrency
    at ``max_model_len``); the fields only the engine core resolves (KV layout, hash block
    size, CPU blocks) stay ``None`` there."""
    per_request_blocks = -(-max_model_len // block_size)
    concurrency = num_gpu_blocks / per_request_blocks  # get_max_concurrency_for_kv_cache_config
    fields: dict[str, object] = {
        "block_size": block_size,
        "user_specified_block_size": user_specified_block_size,
        "kv_cache_layout": None,
        "prefix_match_unit": None,
        "gpu_memory_utilization": gpu_memory_utilization,
        "cache_dtype": "auto",
        "is_attention_free": False,
        "num_gpu_blocks_override": num_gpu_blocks_override,
        "sliding_window": None,
        "enable_prefix_caching": True,
        "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": 0,
        "kv_cache_dtype_skip_layers": [],
        "mamba_page_size_padded": None,
        "skip_page_size_padded": None,
        "mamba_block_size": None,
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": False,
        "replayssm_buffer_len": 16,
        "use_replayssm": False,
        "use_kda_recoverssm": False,
        "num_gpu_blocks": num_gpu_blocks,
        "num_cpu_blocks": None,
        "effective_attention_block_size": block_size,
        "kv_cache_size_tokens": int(concurrency * max_model_len),
        "kv_cache_max_concurrency": concurrency,
        "hash_block_size": None,
        "cache_hit_alignment_tokens": None,
        "kv_sharing_fast_prefill": False,
        "swa_bounded_replay": True,
        "kv_cache_memory_bytes": None,
        "kv_offloading_size": None,
        "kv_offloading_backend": "native",
        "_block_size_resolved": True,  # a pydantic dataclass's private field, in __dict__ too
    }
    return {k: str(v) for k, v in fields.items()}


class EngineStats(Protocol):
    """What the scrape reads from the engine (:class:`skymesh.replica_sim.engine.Engine`)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def prompt_tokens_total(self) -> int: ...
    @property
    def generation_tokens_total(self) -> int: ...


class EngineCollector:
    """vLLM's engine gauges and token counters, read from the engine at scrape time."""

    def __init__(self, engine: EngineStats, model_name: str) -> None:
        self.engine = engine
        self.label_values = [model_name, ENGINE_INDEX]
        # the counters count from the engine's start; vLLM's _created is when it registered them
        self.created = time.time()

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, help_text, labels=LABEL_NAMES)
        g.add_metric(self.label_values, value)
        return g

    def _counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, help_text, labels=LABEL_NAMES)
        c.add_metric(self.label_values, value, created=self.created)
        return c

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          e.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          e.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          e.kv_cache_usage)
        yield self._counter("vllm:prefix_cache_queries",
                            "Prefix cache queries, in terms of number of queried tokens.", e.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            e.prefix_cache_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            e.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens_total)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            e.generation_tokens_total)


class ReplicaMetrics:
    """The vLLM metric set of one stand-in replica, in its own registry (several replicas
    share a process in tests and benchmarks)."""

    def __init__(self, engine: EngineStats, model_name: str, max_model_len: int, *,
                 cache_config_info: Mapping[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        # registration order is the page's order: engine gauges and counters first, as before
        self.registry.register(EngineCollector(engine, model_name))
        label_values = (model_name, ENGINE_INDEX)
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            (*LABEL_NAMES, "finished_reason"), registry=self.registry,
        )
        self._success_by_reason = {r: self.request_success.labels(*label_values, r) for r in FINISH_REASONS}

        def hist(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            # vLLM's histograms have one label set: hand out that child, so an observation
            # is one call with no label lookup
            h = Histogram(name, help_text, LABEL_NAMES, buckets=buckets, registry=self.registry)
            return h.labels(*label_values)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                  token_buckets)
        self.generation_tokens = hist("vllm:request_generation_tokens",
                                      "Number of generation tokens processed.", token_buckets)
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
        if cache_config_info is not None:
            # registered last of vLLM's, as vLLM registers it once its engine is up
            labels = {**cache_config_info, "engine": ENGINE_INDEX}
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(labels),
                         registry=self.registry)
            info.labels(**labels).set(1)
        # not a vLLM metric: the stand-in's own supervision counter, a family of its own
        # after vLLM's so the vLLM lines above are unchanged
        self.loop_restarts = Counter("skymesh_loop_restarts", "Background loops restarted after an exception.",
                                     ("loop",), registry=self.registry)
        self.loop_restarts.labels("engine")  # present at 0 from the start

    def finished(self, reason: str, e2e_s: float, queue_s: float, prefill_s: float, decode_s: float,
                 prompt_tokens: int, generation_tokens: int) -> None:
        self._success_by_reason[reason].inc()
        if reason == "abort":
            return  # vLLM records latency histograms only for completed requests
        self.e2e.observe(e2e_s)
        self.queue_time.observe(queue_s)
        self.prefill_time.observe(prefill_s)
        self.decode_time.observe(decode_s)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
