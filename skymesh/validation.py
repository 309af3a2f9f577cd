"""Pydantic validation errors in the operator's words: ``path: message``.

Every model of the mesh config and of the policy options is checked by pydantic; this
module is the one place that turns a pydantic error (a ``loc`` tuple and an error type)
into the path an operator can find in their YAML (``regions[1].replicas[0].url``) and a
message that says what was expected. Pure: imports nothing but pydantic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails


class PathError(ValueError):
    """A value is wrong; ``path`` says exactly where.

    Raised inside a validator, ``path`` is relative to the model or field being validated
    (``"replicas[1].id"`` from a region's validator); :func:`describe_error` prefixes the
    location pydantic reports for that validator.
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


class PathErrors(ValueError):
    """Several independent wrong values found by one validator, reported together; each
    ``PathError``'s path is relative to what the validator validates."""

    def __init__(self, errors: Sequence[PathError]) -> None:
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = tuple(errors)


def loc_path(loc: Sequence[int | str]) -> str:
    """``("regions", 1, "replicas", 0, "url")`` -> ``"regions[1].replicas[0].url"``."""
    path = ""
    for part in loc:
        path = join_path(path, f"[{part}]" if isinstance(part, int) else part)
    return path


def join_path(base: str, relative: str) -> str:
    if not base or not relative:
        return base or relative
    return base + relative if relative.startswith("[") else f"{base}.{relative}"


def kind(value: Any) -> str:
    """What a YAML value is, for "expected X, got Y" messages."""
    if value is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _got(value: Any) -> str:
    # a wrong scalar is shown as written (the operator greps for it); containers by kind
    if isinstance(value, str):
        return repr(value) if value else "an empty string"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    return kind(value)


_EXPECTED = {
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dict_type": "a mapping",
    "dataclass_type": "a mapping",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a non-empty string",
    "string_too_short": "a non-empty string",
    "list_type": "a list",
    "tuple_type": "a list",
}

_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def describe_error(error: ErrorDetails) -> tuple[str, str]:
    """The ``(path, message)`` of one pydantic error."""
    path = loc_path(error["loc"])
    kind_ = error["type"]
    value = error.get("input")
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    cause = ctx.get("error")
    if isinstance(cause, PathError):
        return join_path(path, cause.path), cause.message
    if kind_ == "missing":
        return path, "is required"
    if kind_ == "extra_forbidden":
        return path, "unknown key"
    if kind_ in _EXPECTED:
        return path, f"expected {_EXPECTED[kind_]}, got {_got(value)}"
    if kind_ in _BOUNDS:
        op, key = _BOUNDS[kind_]
        return path, f"must be {op} {ctx[key]}, got {value}"
    if kind_ == "too_short":
        if ctx.get("min_length") == 1:
            return path, "must not be empty"
        return path, f"needs at least {ctx.get('min_length')} items, got {ctx.get('actual_length')}"
    if kind_ == "too_long":
        return path, f"takes at most {ctx.get('max_length')} items, got {ctx.get('actual_length')}"
    if kind_ == "literal_error":
        return path, f"expected {ctx.get('expected')}, got {_got(value)}"
    if kind_ == "value_error" and cause is not None:
        return path, str(cause)
    return path, error["msg"]


def describe_errors(error: ErrorDetails) -> list[tuple[str, str]]:
    """The ``(path, message)`` pairs of one pydantic error: one, or each of the
    :class:`PathErrors` a validator raised."""
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, PathErrors):
        base = loc_path(error["loc"])
        return [(join_path(base, e.path), e.message) for e in cause.errors]
    return [describe_error(error)]


def all_errors(exc: ValidationError) -> list[tuple[str, str]]:
    """Every error pydantic found, in document order (fields are checked in declaration
    order), each ``(path, message)`` once: an operator fixes them in one pass."""
    errors = exc.errors(include_url=False)
    # a list too short only because its items were wrong ("regions: must not be empty"
    # when the one region has an error) is no mistake of its own
    item_paths = [loc_path(e["loc"]) for e in errors]
    out: list[tuple[str, str]] = []
    for error, path in zip(errors, item_paths, strict=True):
        if error["type"] == "too_short" and any(p.startswith(path + "[") for p in item_paths):
            continue
        for found in describe_errors(error):
            if found not in out:
                out.append(found)
    return out


def first_error(exc: ValidationError) -> tuple[str, str]:
    """The first error pydantic found (fields are checked in declaration order, so this is
    the first wrong value of the document)."""
    return all_errors(exc)[0]
