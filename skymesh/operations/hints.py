"""The commands `skymesh up` prints for querying the mesh, runnable as printed from the
directory it was started in: the `skymesh` executable by the path that runs it (the
venv's script is not on PATH unless the venv is active), the DNS check with `skymesh
resolve` (no package beyond the project's), and the admin token's file or variable
spelled out in a curl line for the controller's API."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from skymesh.config import MeshConfig, RegionConfig
from skymesh.operations.invocation import shell_path, skymesh_command
from skymesh.operations.status import controller_url
from skymesh.security.admin_auth import DEFAULT_STATE_DIR, LOCAL_TOKEN_FILE


def admin_token_shell(cfg: MeshConfig, state_dir: Path) -> tuple[str, str]:
    """(where the admin token is, a shell expression for it inside double quotes), in the
    order the mesh's processes look for it (skymesh/security/admin_auth.py)."""
    env = cfg.admin.token_env
    if os.environ.get(env, "").strip():
        return f"${env}", f"${env}"
    path = Path(state_dir) / LOCAL_TOKEN_FILE  # what `skymesh up` creates when no other is found
    if cfg.admin.token_file and Path(cfg.admin.token_file).expanduser().is_file():
        path = Path(cfg.admin.token_file).expanduser()
    return shell_path(path), f"$(cat {shell_path(path)})"


def query_hints(cfg: MeshConfig, example: RegionConfig, client: str | None, config_arg: str | None,
                state_dir: Path) -> list[str]:
    """The "Query it" lines: resolve the name as a client of ``example`` (source address
    ``client``), a completion through it, the status table and the controller's API."""
    sm = skymesh_command()
    config = f" --config {shlex.quote(config_arg)}" if config_arg else ""
    source = f" --source {client}" if client else ""
    port = example.balancer.advertise.port
    lines = [f"Query it (as a client in {example.name}" + (f", source {client}):" if client else "):")]
    if cfg.dns.provider == "embedded" and cfg.dns.listen is not None:
        lines += [
            f"  {sm} resolve{source}{config}      # what the DNS name gives this client",
            f"  curl{f' --interface {client}' if client else ''} --resolve "
            f"{cfg.dns.name}:{port}:$({sm} resolve --short{source}{config}) \\",
            f"       http://{cfg.dns.name}:{port}/v1/completions -H 'Content-Type: application/json' \\",
        ]
    else:
        lines.append(f"  curl {example.balancer.advertise_url}/v1/completions -H 'Content-Type: application/json' \\")
    lines.append(f"       -d '{{\"model\": \"{cfg.model}\", \"prompt\": \"hello mesh\", \"max_tokens\": 8}}'")
    state = "" if Path(state_dir) == DEFAULT_STATE_DIR else f" --state-dir {shell_path(Path(state_dir))}"
    lines.append(f"  {sm} status{config}{state}      # add --watch to refresh, --json for machines")
    where, token = admin_token_shell(cfg, state_dir)
    lines += [f"  curl -H \"Authorization: Bearer {token}\" {controller_url(cfg)}/v1/status"
              f"      # the controller's API (admin token: {where})"]
    return lines
