"""The region's autoscaling signal: predicted seconds of prefill work waiting per healthy
replica, and its publisher to CloudWatch.

The signal is the region core's pending prefill tokens (queued at the balancer, and
dispatched to a replica without a first token yet) priced by the region's TTFT model
(seconds of prefill per token, refitted online from observed first tokens), divided by
the replicas that are healthy now. It reads "how many seconds each replica would need to
clear what is waiting", so one target value means the same thing whatever the model,
the hardware or the prompt lengths: the region's replica Auto Scaling group tracks it
(terraform/modules/region). With no healthy replica, the work is counted as if one
replica had to do it all, so a region that lost its replicas asks for more. In a region
of several balancers each one counts its siblings' pending prefill too (their last
sibling message), so every balancer publishes the region's value and the group's Average
over them is the region's, not 1/N of it.

:class:`CloudWatchSignal` puts one data point every ``interval_s`` (namespace and metric
from ``autoscaling.cloudwatch``, dimension ``Region``) from a supervised loop; boto3 runs
in a thread (default executor), so a slow or failing CloudWatch never blocks the event
loop, and a failed put is logged and retried at the next interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import boto3

from skymesh.balancer.services import SupervisedService
from skymesh.config import CloudWatchSignalConfig, MeshConfig
from skymesh.routing.region import RegionCore

log = logging.getLogger("skymesh.balancer.autoscaling")

DIMENSION = "Region"
LOOP_NAME = "autoscaling_signal"


def pending_prefill_s_per_replica(core: RegionCore) -> float:
    """Seconds of prefill work waiting per healthy replica (see the module docstring)."""
    pending = core.view.region_pending_prefill_tokens()  # siblings' too: every balancer says the region's
    healthy = sum(1 for view in core.view.replicas.values() if view.healthy)
    return core.model.prefill_s(pending) / max(1, healthy)


class CloudWatchClient(Protocol):
    """The part of boto3's CloudWatch client the publisher calls."""

    def put_metric_data(self, **kwargs: Any) -> Any: ...


class SignalSource(Protocol):
    """What the publisher reads off the balancer (skymesh.balancer.server.Balancer)."""

    region: str
    cfg: MeshConfig

    @property
    def core(self) -> RegionCore: ...

    extra_services: list[Any]


def boto3_cloudwatch(aws_region: str) -> CloudWatchClient:
    """A CloudWatch client in ``aws_region`` (credentials from boto3's chain: on AWS, the
    instance role, which may put data in the configured namespace only)."""
    client: CloudWatchClient = boto3.client("cloudwatch", region_name=aws_region)
    return client


class CloudWatchSignal(SupervisedService):
    """Publishes ``signal()`` to CloudWatch every ``cfg.interval_s`` (a balancer service:
    ``start`` / ``stop``, its loop's restarts counted in skymesh_loop_restarts_total)."""

    def __init__(
        self,
        region: str,
        cfg: CloudWatchSignalConfig,
        signal: Callable[[], float],
        client_factory: Callable[[], CloudWatchClient],
    ) -> None:
        super().__init__()
        self.region = region
        self.cfg = cfg
        self.signal = signal
        self._client_factory = client_factory
        self._client: CloudWatchClient | None = None
        self._task: asyncio.Task[None] | None = None
        self.published = 0  # data points CloudWatch accepted
        self.failed = 0  # puts that raised (logged; the next interval tries again)

    def _put(self, value: float) -> None:
        """One PutMetricData call (in a worker thread)."""
        if self._client is None:
            self._client = self._client_factory()
        self._client.put_metric_data(
            Namespace=self.cfg.namespace,
            MetricData=[{
                "MetricName": self.cfg.metric_name,
                "Dimensions": [{"Name": DIMENSION, "Value": self.region}],
                "Value": value,
                "Unit": "Seconds",
            }],
        )

    async def publish_once(self) -> float:
        """Reads the signal on the event loop (the region core is not thread-safe) and puts
        it from a worker thread; returns the value put. Raises what boto3 raised."""
        value = float(self.signal())
        await asyncio.get_running_loop().run_in_executor(None, functools.partial(self._put, value))
        self.published += 1
        return value

    async def _loop(self) -> None:
        while True:
            try:
                await self.publish_once()
            except Exception as e:  # CloudWatch down, throttled, no credentials: try next time
                self.failed += 1
                log.warning("publishing the autoscaling signal failed: %s", e,
                            extra={"region": self.region, "namespace": self.cfg.namespace})
            await asyncio.sleep(self.cfg.interval_s)

    async def start(self) -> None:
        self._task = self._supervised(LOOP_NAME, self._loop, backoff_s=1.0,
                                      max_backoff_s=max(1.0, self.cfg.interval_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def attach_autoscaling_signal(
    b: SignalSource, client_factory: Callable[[], CloudWatchClient] | None = None
) -> CloudWatchSignal | None:
    """Adds the CloudWatch publisher to ``b``'s services when ``autoscaling.cloudwatch`` is
    configured (its client in the region's AWS region); None when it is not."""
    cw = b.cfg.autoscaling.cloudwatch
    if cw is None:
        return None
    region_cfg = b.cfg.region(b.region)
    aws_region = region_cfg.aws_region or region_cfg.name
    factory = client_factory or functools.partial(boto3_cloudwatch, aws_region)
    svc = CloudWatchSignal(b.region, cw, lambda: pending_prefill_s_per_replica(b.core), factory)
    b.extra_services.append(svc)
    return svc
