"""What every config model shares: the frozen, strict :class:`ConfigModel`, the strict
scalar types (a YAML ``"yes"`` is not a boolean, ``2.0`` is not an integer), the builders of
values written as one string, and :class:`ConfigError`, which names the exact path of a
wrong value (``regions[0].name``) so an operator can fix a config without reading code."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    Strict,
    WithJsonSchema,
    model_validator,
)

from skymesh.assets import resolve_file_ref
from skymesh.validation import PathError, PathErrors, kind


class ConfigError(PathError):
    """A config value is wrong; ``path`` says exactly where (``regions[0].name``).

    Validators raise it with a path relative to what they validate; :func:`parse_config`
    raises it with the full path.
    """


class ConfigErrors(ConfigError):
    """Several wrong values of one config, each ``(path, message)`` with its full path;
    ``path`` and ``message`` are the first's. Printed one per line."""

    def __init__(self, errors: Sequence[tuple[str, str]]) -> None:
        super().__init__(*errors[0])
        self.errors = tuple(errors)

    def __str__(self) -> str:
        return f"{len(self.errors)} errors:\n" + "\n".join(f"  {p}: {m}" for p, m in self.errors)


class ErrorCollector:
    """The independent checks of one validator, each problem kept instead of the first
    stopping the rest: ``errors.add(path, message)`` per problem, then
    ``errors.raise_found()``."""

    def __init__(self) -> None:
        self.found: list[PathError] = []

    def add(self, path: str, message: str) -> None:
        self.found.append(ConfigError(path, message))

    def raise_found(self) -> None:
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise PathErrors(self.found)


def first_repeat(values: Iterable[Hashable]) -> tuple[int, int] | None:
    """(index, index of its first occurrence) of the first value seen twice, or None."""
    seen: dict[Hashable, int] = {}
    for i, value in enumerate(values):
        if value in seen:
            return i, seen[value]
        seen[value] = i
    return None


def nonempty_str(value: Any) -> str:
    """``value`` if it is a non-empty string; the first check of every string parser."""
    if not isinstance(value, str) or not value:
        raise ConfigError("", f"expected a non-empty string, got {kind(value)}")
    return value


def or_null(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``parse``, letting None through: for fields whose default another field derives,
    an explicit YAML null means "default"."""
    return lambda value: None if value is None else parse(value)


def matching(pattern: re.Pattern[str], what: str) -> Callable[[str], str]:
    """A check that a string matches ``pattern``; the error says it expected ``what``."""

    def check(value: str) -> str:
        if not pattern.match(value):
            raise ConfigError("", f"expected {what}, got {value!r}")
        return value

    return check


def string_type(parse: Callable[[Any], Any], description: str, **schema: Any) -> Any:
    """A config value written as one string and parsed by ``parse`` (which raises
    ConfigError with the operator's wording); the JSON schema says it is a string."""
    return (
        PlainValidator(parse),
        PlainSerializer(str, return_type=str),
        WithJsonSchema({"type": "string", "description": description, **schema}),
    )


def _file_path(value: Any) -> str:
    """A local file's path as written, or a ``pkg:<package>/<path>`` reference resolved to
    the file shipped inside that package (skymesh/assets/__init__.py)."""
    try:
        return resolve_file_ref(nonempty_str(value))
    except ValueError as e:
        raise ConfigError("", str(e)) from None


Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # a YAML integer is a number too
Bool = Annotated[bool, Strict()]
Text = Annotated[str, Strict(), Field(min_length=1)]
Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
# a local file: a path (relative to the reading process's working directory), or
# pkg:<package>/<path> for one shipped inside a Python package, resolved when loaded
FilePath = Annotated[str, *string_type(
    _file_path, "a local file path, or pkg:<package>/<path> for a file shipped inside a Python package")]


def set_derived(model: BaseModel, field: str, value: Any) -> None:
    """Fill in a derived default (an advertise address from the listen address): models
    are frozen, and a validator filling in a derived default is the one writer."""
    object.__setattr__(model, field, value)


class ConfigModel(BaseModel):
    """Base of every config model: frozen, unknown keys rejected with the allowed ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_keys(cls, data: Any) -> Any:
        # extra="forbid" would reject them too; this names the keys that are allowed
        if isinstance(data, Mapping):
            allowed = {f.alias or name for name, f in cls.model_fields.items()}
            unknown = sorted(str(k) for k in data if k not in allowed)
            if unknown:
                raise ConfigError(unknown[0], f"unknown key (allowed: {', '.join(sorted(allowed))})")
        return data
