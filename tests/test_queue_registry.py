"""The queue discipline registry: the one list of names that the config, the region core
and the benchmarks' command lines (simulator and live bench) all take; options read from
the config's ``queue:`` keys; and a discipline that implements one hook only, the rest
left to the base class's defaults."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, get_args

import pytest

from skymesh.bench import live, sim_setup
from skymesh.config import QueueConfig
from skymesh.routing.base import PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.disciplines.base import DisciplineContext, QueueDiscipline
from skymesh.routing.disciplines.prefix_match import PrefixMatchOptions, PrefixMatchOrder
from skymesh.routing.disciplines.slo_deadline import SloDeadlineOptions, SloDeadlineOrder
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.health import ProbeSample
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.queue_registry import (
    DISCIPLINES,
    DisciplineName,
    UnknownDisciplineError,
    make_discipline,
)
from skymesh.routing.queueing import PriorityQueue
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import SendToReplica
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy


def _cli_choices(add_arguments: Callable[[argparse.ArgumentParser], None]) -> tuple[str, ...]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    (action,) = [a for a in p._actions if "--queue-discipline" in a.option_strings]
    return tuple(action.choices or ())


def test_the_registry_the_config_and_both_command_lines_name_the_same_disciplines() -> None:
    names = tuple(DISCIPLINES)
    assert get_args(DisciplineName) == names
    assert get_args(QueueConfig.model_fields["discipline"].annotation) == names
    assert _cli_choices(sim_setup.add_arguments) == names
    assert _cli_choices(live.add_arguments) == names
    for name in names:
        assert QueueConfig.model_validate({"discipline": name}).discipline == name


def test_every_option_a_discipline_reads_is_a_queue_key_the_config_and_region_settings_carry() -> None:
    config_keys = set(QueueConfig.model_fields)
    region_keys = set(RegionSettings().queue_settings())
    for name, spec in DISCIPLINES.items():
        fields = {f.name for f in dataclasses.fields(spec.options)}
        assert fields <= config_keys, name
        assert fields <= region_keys, name
    # the defaults agree, so a config without a queue: section builds the options the registry does
    defaults = QueueConfig().model_dump()
    for spec in DISCIPLINES.values():
        assert spec.options.from_queue_settings(defaults) == spec.options()


def test_the_registry_builds_each_discipline_from_the_queue_settings() -> None:
    ctx = DisciplineContext(model=RegionModel(chunk_tokens=16, prefill_s_per_token=1e-4), default_slo_s=2.0)
    settings = {"window": 4, "iterations": 7, "max_age_s": 9.0, "prefix_ttft_share": 0.25, "discipline": "slo"}
    assert make_discipline("fcfs", settings, ctx) is None  # the queue's own order: no discipline
    slo = make_discipline("slo", settings, ctx)
    assert isinstance(slo, SloDeadlineOrder)
    assert (slo.window, slo.iterations, slo.max_age_s, slo.default_slo_s) == (4, 7, 9.0, 2.0)
    prefix = make_discipline("prefix", settings, ctx)
    assert isinstance(prefix, PrefixMatchOrder)
    assert (prefix.chunk_tokens, prefix.max_age_s, prefix.ttft_share, prefix.default_slo_s) == (16, 9.0, 0.25, 2.0)
    assert SloDeadlineOptions.from_queue_settings({}) == SloDeadlineOptions()
    assert PrefixMatchOptions.from_queue_settings({"max_age_s": 3.0}).max_age_s == 3.0
    with pytest.raises(UnknownDisciplineError, match="known: fcfs, slo, prefix"):
        make_discipline("lifo", settings, ctx)


class _CountsDispatches(QueueDiscipline):
    """Implements one hook; every other one is the base class's default."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        self.sent.append((req.request_id, replica_id))


class _Reverses(QueueDiscipline):
    """Implements the order only: the newest queued request first."""

    def dispatch_order(self, queue: PriorityQueue[Any], replicas: Mapping[str, ReplicaView],
                       free_slots: Mapping[str, int], now: float,
                       excluded: Callable[[str], AbstractSet[str]] | None = None) -> list[str]:
        return queue.ids()[::-1]


def _req(i: int, arrival: float) -> RoutingRequest:
    text = " ".join(f"q{i}w{k}" for k in range(64))
    return RoutingRequest(f"q{i}", prompt_chunk_hashes(text, 64), 64, arrival)


def _placed(discipline: QueueDiscipline | None) -> list[str]:
    core = RegionCore("here", make_policy("least_load", PolicyContext()), OffloadRouter("here", {}, enabled=False),
                      RegionSettings(dispatch_budget=1, early_rejection=False))
    core.local.discipline = discipline
    core.set_replicas(["r0", "r1"], 0.0)
    for i in range(4):
        assert core.submit(_req(i, 0.1 * i), 0.1 * i) == []
    for rid in ("r0", "r1"):
        core.probe(rid, ProbeSample(), 0.5)
    placed = [a.request_id for a in core.tick(0.5) if isinstance(a, SendToReplica)]
    core.complete(placed[0], 0.6)
    assert core.local.queue_length == 4 - len(placed)
    if discipline is not None:  # its own counters in the status, the base class's none by default
        assert core.local.snapshot()["discipline"] == discipline.stats()
    return placed


def test_a_discipline_with_one_hook_keeps_the_queue_order_and_hears_its_event() -> None:
    fcfs = _placed(None)
    counting = _CountsDispatches()
    assert _placed(counting) == fcfs == ["q0", "q1"]
    assert [rid for rid, _ in counting.sent] == fcfs
    assert counting.stats() == {}


def test_a_discipline_with_only_an_order_is_followed() -> None:
    assert _placed(_Reverses()) == ["q3", "q2"]

