"""The controller's Prometheus metrics, written with skymesh.prom for now (one family; a
port to prometheus_client is a Counter with the same name and label)."""

from __future__ import annotations

from skymesh.prom import Counter, Registry

# the controller's supervised background loops, pre-created at 0 so a scrape shows them
# before the first restart
LOOPS = ("probe", "dns-sync")


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = Registry()
        self.loop_restarts = Counter(
            "skymesh_loop_restarts_total", "Background loops restarted after an exception.", ("loop",)
        )
        for loop in LOOPS:
            self.loop_restarts.inc(loop, amount=0.0)
        self.registry.add(self.loop_restarts)

    def loop_restarted(self, name: str, exc: BaseException) -> None:
        """The on_restart hook of the controller's supervised loops."""
        self.loop_restarts.inc(name)

    def render(self) -> str:
        return self.registry.render()
