"""Reading a config: YAML (a key given twice in one mapping is an error) into a validated
:class:`~skymesh.config.mesh.MeshConfig`, with the file's SHA-256 that daemons name their
loaded config by, and the JSON schema of the format (``skymesh config --schema``)."""

from __future__ import annotations

import hashlib
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from skymesh.config.base import ConfigError, ConfigErrors
from skymesh.config.mesh import MeshConfig
from skymesh.validation import all_errors


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML forbids it,
    and PyYAML would keep the last silently (a second ``offload:`` or ``slo_classes:``
    pasted at the end of a file would replace the first without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *anchor": keys given beside it override the merged ones
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: the base constructor reports it
                break
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (given before in this mapping)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_config(data: Any, profiles: set[str] | None = None) -> MeshConfig:
    """Validate a parsed YAML document into a :class:`MeshConfig`; every wrong value is
    reported at once (:class:`ConfigErrors` when there are several).

    ``profiles``: the replica-sim profile names a sim replica may use (default: the
    packaged ones).
    """
    context = None if profiles is None else {"profiles": profiles}
    try:
        return MeshConfig.model_validate(data, context=context)
    except ValidationError as e:
        found = [(path or "<root>", message) for path, message in all_errors(e)]
        if len(found) == 1:
            raise ConfigError(*found[0]) from None
        raise ConfigErrors(found) from None


def config_schema() -> dict[str, Any]:
    """The JSON schema of the config file (``skymesh config --schema``)."""
    return MeshConfig.model_json_schema()


def load_config(path: str | Path | None = None) -> MeshConfig:
    """Load a YAML file; ``None`` loads the embedded local 3-region default."""
    return load_config_digest(path)[0]


def load_config_for_command(path: str | Path | None) -> MeshConfig | None:
    """:func:`load_config` for a command line tool: a config error is printed as one
    ``config error: ...`` line on stderr and gives None (the command then exits 2)."""
    try:
        return load_config(path)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return None


def load_config_digest(path: str | Path | None = None) -> tuple[MeshConfig, str]:
    """:func:`load_config`, and the SHA-256 (hex) of the bytes it parsed: what a daemon
    names its loaded config by (/admin/status, the controller's status, reload logs)."""
    if path is None:
        raw = resources.files("skymesh").joinpath("local.yaml").read_bytes()
        src = "<embedded local.yaml>"
    else:
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise ConfigError("", f"cannot read config {p}: {e.strerror}") from None
        src = str(p)
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise ConfigError("", f"{src} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{src} is not valid YAML: {e}") from None
    return parse_config(data), hashlib.sha256(raw).hexdigest()
