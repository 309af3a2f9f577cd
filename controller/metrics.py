"""The controller's Prometheus metrics (prometheus_client, its own registry: tests run
controllers beside balancers and stand-ins in one process)."""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    ProcessCollector,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from skymesh.edge.connection_metrics import EdgeMetrics

# the controller's supervised background loops, pre-created at 0 so a scrape shows them
# before the first restart
LOOPS = ("probe", "dns-sync")
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
TAKEN_OUT_REASONS = ("probes", "siblings")


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # the process (CPU, memory, open files), the Python build and its GC
        ProcessCollector(registry=self.registry)
        self.registry.register(PLATFORM_COLLECTOR)
        self.registry.register(GC_COLLECTOR)
        # the HTTP API's connection gauge, cap refusals and parser rejections (skymesh/edge/)
        self.edge = EdgeMetrics.create(self.registry)
        self.loop_restarts = Counter(
            "skymesh_loop_restarts", "Background loops restarted after an exception.", ("loop",),
            registry=self.registry,
        )
        for loop in LOOPS:
            self.loop_restarts.labels(loop)
        # gRPC calls refused by mesh identity: a certificate acting for another region, a
        # registration naming addresses the config does not give its region, or a
        # deregistration from a registration that is not the current one
        self.rejected_calls = Counter(
            "skymesh_controller_rejected_calls", "Balancer calls refused by mesh identity or registration.", ("reason",),
            registry=self.registry,
        )
        for reason in ("wrong_identity", "wrong_address", "stale_deregister"):
            self.rejected_calls.labels(reason)
        # config reloads on SIGHUP (controller/reload_rules.py): ok, or error (an invalid file, or
        # one changing settings that need a restart; the running config stayed)
        self.config_reloads = Counter(
            "skymesh_controller_config_reloads", "Config reloads (SIGHUP) by result.", ("result",),
            registry=self.registry,
        )
        for result in ("ok", "error"):
            self.config_reloads.labels(result)

        # each region's balancers (a fleet): how many it has, how many are alive; the
        # region is alive while the second is above 0
        self.balancers = Gauge("skymesh_controller_balancers", "Balancers of a region known to the controller.",
                               ("region",), registry=self.registry)
        self.balancers_alive = Gauge("skymesh_controller_balancers_alive", "Balancers of a region alive.",
                                     ("region",), registry=self.registry)

        # members marked dead by the controller: "probes" (failure_threshold failed probes,
        # or no report lately where it cannot probe), "siblings" (controller/sibling_watch.py)
        self.members_taken_out = Counter(
            "skymesh_controller_members_taken_out", "Balancers of a region marked dead, by what showed it.",
            ("region", "reason"), registry=self.registry,
        )

    def region_known(self, region: str) -> None:
        """The region's series, at 0 before anything happens."""
        for reason in TAKEN_OUT_REASONS:
            self.members_taken_out.labels(region, reason)

    def loop_restarted(self, name: str, exc: BaseException) -> None:
        """The on_restart hook of the controller's supervised loops."""
        self.loop_restarts.labels(name).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
