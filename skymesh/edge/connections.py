"""Open connections counted in all and per source address, against their caps."""

from __future__ import annotations


class ConnectionLimiter:
    """Slots for open connections: ``open`` takes one or says which cap refused it
    ("total" or "per_source"); ``close`` gives it back. Per-source counts are dropped at
    zero, so the table is bounded by the open connections."""

    __slots__ = ("max_total", "max_per_source", "total", "_by_source")

    def __init__(self, max_total: int, max_per_source: int) -> None:
        self.max_total = max_total
        self.max_per_source = max_per_source
        self.total = 0
        self._by_source: dict[str, int] = {}

    def open(self, source: str) -> str | None:
        if self.total >= self.max_total:
            return "total"
        held = self._by_source.get(source, 0)
        if held >= self.max_per_source:
            return "per_source"
        self._by_source[source] = held + 1
        self.total += 1
        return None

    def close(self, source: str) -> None:
        held = self._by_source.get(source, 0)
        if held <= 0:
            return
        if held == 1:
            del self._by_source[source]
        else:
            self._by_source[source] = held - 1
        self.total -= 1

    def held_by(self, source: str) -> int:
        return self._by_source.get(source, 0)
