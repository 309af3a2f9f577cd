"""The region's autoscaling signal, as the balancers publish it (``autoscaling:``): the
predicted seconds of prefill work waiting per healthy replica
(skymesh/balancer/autoscaling_signal.py). Always a Prometheus gauge; with ``cloudwatch``
also a CloudWatch metric, which the region's replica Auto Scaling group tracks
(terraform/modules/region)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from skymesh.config.base import ConfigModel, Float, Text, matching

# CloudWatch's rules: 1-255 of these characters; "AWS/" is reserved for AWS's own metrics
CLOUDWATCH_NAMESPACE_RE = re.compile(r"^(?!AWS/)[0-9A-Za-z.\-_/#:]{1,255}$")
CLOUDWATCH_METRIC_RE = re.compile(r"^[0-9A-Za-z.\-_/#:]{1,255}$")

CloudWatchNamespace = Annotated[
    Text,
    AfterValidator(matching(CLOUDWATCH_NAMESPACE_RE, "a CloudWatch namespace like SkyMesh (not AWS/...)")),
    Field(json_schema_extra={"pattern": CLOUDWATCH_NAMESPACE_RE.pattern}),
]
CloudWatchMetricName = Annotated[
    Text,
    AfterValidator(matching(CLOUDWATCH_METRIC_RE, "a CloudWatch metric name like PendingPrefillSecondsPerReplica")),
    Field(json_schema_extra={"pattern": CLOUDWATCH_METRIC_RE.pattern}),
]


class CloudWatchSignalConfig(ConfigModel):
    """Where every balancer puts the signal (PutMetricData, one data point an interval,
    dimension ``Region`` = its region's name), in its region's AWS region
    (``regions[].aws_region``, default the region's name)."""

    namespace: CloudWatchNamespace = "SkyMesh"
    metric_name: CloudWatchMetricName = "PendingPrefillSecondsPerReplica"
    # seconds between data points; the Auto Scaling policy reads one-minute periods
    interval_s: Annotated[Float, Field(ge=1, le=3600)] = 60.0


class AutoscalingConfig(ConfigModel):
    # None: the signal is only a Prometheus gauge
    cloudwatch: CloudWatchSignalConfig | None = None
