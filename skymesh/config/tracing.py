"""OpenTelemetry tracing of the balancers (``tracing:``): where spans go (an OTLP/HTTP
collector), the service name, the share of new traces sampled, and extra resource
attributes. Off unless ``endpoint`` is set; then every balancer sends one trace per sampled
request (skymesh/balancer/tracing.py, docs/observability.md)."""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import urlparse

from pydantic import AfterValidator, Field, model_validator

from skymesh.config.base import ConfigError, ConfigModel, Float, Int, Text, matching
from skymesh.config.network import HttpUrlStr

# an OTLP/HTTP collector's traces path (OTEL_EXPORTER_OTLP_ENDPOINT's default signal path)
OTLP_TRACES_PATH = "/v1/traces"
RESOURCE_KEY_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]{0,127}$")
# the balancer sets these itself (service.name from service_name)
RESERVED_RESOURCE_KEYS = frozenset({"service.name", "service.instance.id", "cloud.region", "skymesh.region",
                                    "skymesh.balancer.id"})

ResourceKey = Annotated[
    Text,
    AfterValidator(matching(RESOURCE_KEY_RE, "an attribute name like deployment.environment")),
]


class TracingBatchConfig(ConfigModel):
    """The span batcher (the SDK's BatchSpanProcessor, exporting in its own thread)."""

    # the longest an ended span waits before its batch is sent
    schedule_delay_ms: Annotated[Int, Field(ge=1, le=60_000)] = 5000
    # spans held while the collector is slow; beyond it new spans are dropped (never blocking)
    max_queue_size: Annotated[Int, Field(ge=1, le=1_000_000)] = 2048
    max_export_batch_size: Annotated[Int, Field(ge=1, le=100_000)] = 512
    # one export request's timeout
    export_timeout_s: Annotated[Float, Field(gt=0, le=300)] = 10.0

    @model_validator(mode="after")
    def _batch_fits_queue(self) -> TracingBatchConfig:
        if self.max_export_batch_size > self.max_queue_size:
            raise ConfigError("max_export_batch_size", f"must be at most max_queue_size ({self.max_queue_size})")
        return self


class TracingConfig(ConfigModel):
    # the collector's OTLP/HTTP traces URL (protobuf); a URL without a path gets /v1/traces.
    # None: tracing off (no span is made, no exporter runs)
    endpoint: HttpUrlStr | None = None
    service_name: Text = "skymesh-balancer"
    # the share of traces begun here that are sampled (a parent-based ratio sampler: a
    # request arriving with a W3C traceparent keeps its caller's decision)
    sampling_ratio: Annotated[Float, Field(ge=0, le=1)] = 1.0
    # added to every span's resource (region and balancer id are set by each balancer)
    resource_attributes: dict[ResourceKey, Text] = Field(default_factory=dict)
    batch: TracingBatchConfig = Field(default_factory=TracingBatchConfig)

    @model_validator(mode="after")
    def _no_reserved_attributes(self) -> TracingConfig:
        for key in self.resource_attributes:
            if key in RESERVED_RESOURCE_KEYS:
                raise ConfigError(f"resource_attributes.{key}", "is set by each balancer itself")
        return self

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    @property
    def traces_url(self) -> str | None:
        """Where the exporter posts (``endpoint``, with /v1/traces when it has no path)."""
        if self.endpoint is None:
            return None
        return self.endpoint + OTLP_TRACES_PATH if urlparse(self.endpoint).path in ("", "/") else self.endpoint
