"""Config reload on SIGHUP, the parts the balancer and the controller share.

A reload is all or nothing. The new file is read and validated off the event loop, with
the same code as at start (:func:`skymesh.config.load_config_digest`); then each changed
setting is sorted by a daemon's rules (:func:`plan`) into the ones it applies live, the
ones only a restart can change, and the ones it does not use. One setting needing a
restart refuses the whole file: nothing is applied, the log line names every such field.

Paths name settings the way an operator finds them in the YAML, regions by name:
``policy.queue_bound``, ``client_auth.keys``, ``regions[us-east-1].balancer.listen``.
Lists other than ``regions`` are compared whole (``client_auth.keys``,
``regions[us-east-1].replicas``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple, TypeVar

from skymesh.config import ConfigError, MeshConfig

SettingPath = tuple[str, ...]
ANY = "*"  # in a rule's pattern: any one path element (e.g. any region name)


class Kind(StrEnum):
    LIVE = "live"  # applied by a reload
    RESTART = "restart"  # only a restart can change it: a file changing it is refused
    UNUSED = "unused"  # not this daemon's setting (another daemon reads it)


# (pattern, kind): the first pattern that is a prefix of a changed path decides its kind
Rules = Sequence[tuple[SettingPath, Kind]]


class ReloadPlan(NamedTuple):
    """What a reload would do: the changed settings (as paths) by :class:`Kind`."""

    changes: tuple[str, ...]  # applied live
    needs_restart: tuple[str, ...]  # refuse the file when any
    unused: tuple[str, ...] = ()  # changed, but not read by this daemon


def path_text(path: SettingPath) -> str:
    """("regions", "us-east-1", "balancer", "listen") -> "regions[us-east-1].balancer.listen"."""
    out = ""
    for i, part in enumerate(path):
        if i == 1 and path[0] == "regions":
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def _leaves(old: Any, new: Any, at: SettingPath) -> Iterator[SettingPath]:
    # mappings of one shape are compared key by key; a different shape (another policy's
    # options, another set of TLS regions) is one change of the whole
    if isinstance(old, Mapping) and isinstance(new, Mapping) and set(old) == set(new):
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key) != new.get(key):
                yield from _leaves(old.get(key), new.get(key), (*at, str(key)))
    elif old != new:
        yield at


def changed_paths(old: MeshConfig, new: MeshConfig) -> list[SettingPath]:
    """Every setting whose value differs, as a path. A region added or removed is the
    one path ``("regions",)``; otherwise regions are compared by name (order aside)."""
    a = old.model_dump(mode="json", by_alias=True)
    b = new.model_dump(mode="json", by_alias=True)
    regions_a = {r["name"]: r for r in a.pop("regions")}
    regions_b = {r["name"]: r for r in b.pop("regions")}
    out = list(_leaves(a, b, ()))
    if set(regions_a) != set(regions_b):
        out.append(("regions",))
    else:
        for name in sorted(regions_a):
            out.extend(_leaves(regions_a[name], regions_b[name], ("regions", name)))
    return sorted(out)


def _matches(pattern: SettingPath, path: SettingPath) -> bool:
    return len(pattern) <= len(path) and all(p in (ANY, x) for p, x in zip(pattern, path, strict=False))


def classify(path: SettingPath, rules: Rules) -> Kind:
    """The kind of the first rule matching ``path``; a setting no rule names needs a
    restart (a new config field is not applied live until someone says it can be)."""
    for pattern, kind in rules:
        if _matches(pattern, path):
            return kind
    return Kind.RESTART


def plan(old: MeshConfig, new: MeshConfig, rules: Rules) -> ReloadPlan:
    by_kind: dict[Kind, list[str]] = {k: [] for k in Kind}
    for path in changed_paths(old, new):
        by_kind[classify(path, rules)].append(path_text(path))
    return ReloadPlan(tuple(by_kind[Kind.LIVE]), tuple(by_kind[Kind.RESTART]), tuple(by_kind[Kind.UNUSED]))


class ReloadRefused(Exception):
    """The new file changes settings that only a restart can change."""

    def __init__(self, needs_restart: Sequence[str]) -> None:
        super().__init__("these settings need a restart: " + ", ".join(needs_restart))
        self.needs_restart = tuple(needs_restart)


@dataclass(slots=True)
class ReloadStatus:
    """The last reload, for a daemon's status page."""

    result: str | None = None  # "ok" | "error"; None: no reload yet
    at_unix: float | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        at = None if self.at_unix is None else round(self.at_unix, 3)
        return {"result": self.result, "at_unix": at, "error": self.error}


Loaded = TypeVar("Loaded")


async def run_reload(
    log: logging.Logger,
    path: str | None,
    load: Callable[[], Loaded],
    apply: Callable[[Loaded], Awaitable[ReloadPlan]],
    on_result: Callable[[str], None],
    status: ReloadStatus,
) -> bool:
    """One reload: ``load`` (blocking: reads and validates the file, and any file the
    config points at) runs in a thread; ``apply`` runs on the event loop and raises
    :class:`ReloadRefused` before changing anything when a setting needs a restart.
    Logs one line either way and calls ``on_result("ok" | "error")``. True when applied."""
    where = path or "<embedded local.yaml>"
    try:
        loaded = await asyncio.to_thread(load)
        result = await apply(loaded)
    except (ConfigError, ReloadRefused) as e:
        what = "config reload refused" if isinstance(e, ReloadRefused) else "config reload failed"
        extra: dict[str, Any] = {"path": where, "error": str(e)}
        if isinstance(e, ReloadRefused):
            extra["needs_restart"] = ",".join(e.needs_restart)
        log.error(f"{what}, the running config stays: {e}", extra=extra)
        status.result, status.at_unix, status.error = "error", time.time(), str(e)
        on_result("error")
        return False
    except Exception as e:  # a bug: the daemon keeps serving, the operator sees why
        log.exception("config reload failed, the running config stays", extra={"path": where})
        status.result, status.at_unix, status.error = "error", time.time(), repr(e)
        on_result("error")
        return False
    log.info("config reloaded", extra={"path": where, "applied": ",".join(result.changes),
                                       "unused_here": ",".join(result.unused)})
    status.result, status.at_unix, status.error = "ok", time.time(), None
    on_result("ok")
    return True
