"""The queue discipline registry, the only list of disciplines: a name → the discipline
class and its options. A new discipline is one file in ``disciplines/`` plus one line
here; the config's ``queue.discipline``, the region core and the benchmarks' command lines
(``skymesh sim``, ``skymesh bench``) ask this registry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from skymesh.routing.disciplines.base import DisciplineContext, DisciplineOptions, QueueDiscipline
from skymesh.routing.disciplines.prefix_match import PrefixMatchOptions, PrefixMatchOrder
from skymesh.routing.disciplines.slo_deadline import SloDeadlineOptions, SloDeadlineOrder

# the names of DISCIPLINES, as a type (the config validates against it; a test checks
# that it names exactly the registry's keys)
DisciplineName = Literal["fcfs", "slo", "prefix"]


@dataclasses.dataclass(frozen=True)
class DisciplineSpec:
    # builds the discipline from its options; None: no discipline, the queue's own order
    factory: Callable[[Any, DisciplineContext], QueueDiscipline] | None
    options: type[DisciplineOptions]


DISCIPLINES: dict[DisciplineName, DisciplineSpec] = {
    "fcfs": DisciplineSpec(None, DisciplineOptions),  # arrival order: the queue as it is, no discipline
    "slo": DisciplineSpec(SloDeadlineOrder.build, SloDeadlineOptions),
    "prefix": DisciplineSpec(PrefixMatchOrder.build, PrefixMatchOptions),  # FEATHER
}


class UnknownDisciplineError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown queue discipline {name!r} (known: {', '.join(DISCIPLINES)})")


def discipline_spec(name: str) -> DisciplineSpec:
    try:
        return DISCIPLINES[name]  # type: ignore[index]
    except KeyError:
        raise UnknownDisciplineError(name) from None


def make_discipline(name: str, queue_settings: Mapping[str, Any], ctx: DisciplineContext) -> QueueDiscipline | None:
    """Discipline ``name`` built from ``ctx`` and the options it reads of ``queue_settings``
    (by the config's ``queue:`` keys); None for ``fcfs``, the queue's own order."""
    spec = discipline_spec(name)
    if spec.factory is None:
        return None
    return spec.factory(spec.options.from_queue_settings(queue_settings), ctx)
