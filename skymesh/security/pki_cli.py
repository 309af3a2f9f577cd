"""`skymesh pki issue --config FILE --out DIR`: a mesh's credentials, issued offline.

Writes, under ``DIR`` (created 0700, every file 0600), what a deployed mesh needs and
``skymesh up`` makes for itself in local mode:

* ``ca.key``, ``ca.crt``: the mesh CA (keep ``ca.key`` off the hosts);
* ``balancer-<region>.{crt,key}`` per region and ``controller.{crt,key}``: each
  component's certificate, named as :mod:`skymesh.security.pki` names them (SAN URI
  ``spiffe://skymesh/region/<region>`` and DNS SAN ``<region>.balancer.skymesh``; the
  controller's ``spiffe://skymesh/controller`` and ``controller.skymesh``);
* ``admin.{crt,key}``: an operator's client certificate;
* ``peer-token`` and ``admin-token``: 256-bit random tokens (``secrets``).

Existing files are never overwritten unless asked: ``--reuse`` keeps everything there and
adds what is missing (a new region's certificate under the same CA, a missing token);
``--force`` issues everything anew (a new CA: every host needs its new files). The
``tls:`` section naming the files (for a config used on this machine) goes to stdout.
terraform/modules/secrets stores the files in AWS Secrets Manager (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml

from skymesh.config import load_config_for_command
from skymesh.security.admin_auth import LOCAL_PEER_TOKEN_FILE, LOCAL_TOKEN_FILE
from skymesh.security.pki import generate_mesh_pki, write_private

Mode = Literal["new", "reuse", "force"]
TOKEN_FILES = (LOCAL_PEER_TOKEN_FILE, LOCAL_TOKEN_FILE)  # "peer-token", "admin-token"


class IssueError(Exception):
    """Issuing would overwrite or contradict what is already in the directory."""


def credential_files(regions: Iterable[str]) -> list[str]:
    """Every file name ``issue`` writes for a mesh of ``regions``."""
    names = ["ca.key", "ca.crt", "controller.crt", "controller.key", "admin.crt", "admin.key"]
    for r in regions:
        names += [f"balancer-{r}.crt", f"balancer-{r}.key"]
    return [*names, *TOKEN_FILES]


def new_token() -> str:
    return secrets.token_urlsafe(32)


def issue(directory: str | Path, regions: list[str], mode: Mode = "new") -> dict[str, Any]:
    """Issues the mesh credentials for ``regions`` under ``directory``; returns the
    config's ``tls`` section naming them. ``mode``: "new" refuses when any of the files
    exists, "reuse" keeps existing ones and adds the missing, "force" replaces them all."""
    d = Path(directory)
    existing = [n for n in credential_files(regions) if (d / n).exists()]
    if mode == "new" and existing:
        raise IssueError(f"{d} already holds {', '.join(existing)}: refusing to overwrite them "
                         "(--reuse keeps them and adds what is missing, --force issues everything anew)")
    ca_parts = [(d / n).exists() for n in ("ca.key", "ca.crt")]
    if mode == "reuse" and any(ca_parts) and not all(ca_parts):
        missing = "ca.key" if not ca_parts[0] else "ca.crt"
        raise IssueError(f"{d / missing} is missing but the other half of the CA is there: restore it to "
                         "issue under that CA, or use --force for a new CA (every host then needs new files)")
    section = generate_mesh_pki(d, regions, reuse=mode == "reuse")
    for name in TOKEN_FILES:
        path = d / name
        if mode == "force" or not path.exists():
            write_private(path, (new_token() + "\n").encode())
    return section


def add_issue_arguments(i: argparse.ArgumentParser) -> None:
    i.add_argument("--config", required=True, help="the mesh YAML (its region names)")
    i.add_argument("--out", required=True, help="directory for the credentials (created 0700, files 0600)")
    how = i.add_mutually_exclusive_group()
    how.add_argument("--reuse", action="store_true",
                     help="keep the files already there, add the missing ones (a new region, a missing token)")
    how.add_argument("--force", action="store_true", help="replace every file, the CA included")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="pki_command", metavar="ACTION")
    sub.required = True
    add_issue_arguments(sub.add_parser(
        "issue", help="issue the mesh CA, every component's certificate and the tokens",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


def run(args: argparse.Namespace) -> int:
    cfg = load_config_for_command(args.config)
    if cfg is None:
        return 2
    mode: Mode = "force" if args.force else "reuse" if args.reuse else "new"
    regions = [r.name for r in cfg.regions]
    try:
        section = issue(args.out, regions, mode)
    except IssueError as e:
        print(f"skymesh pki issue: {e}", file=sys.stderr)
        return 1
    print(f"mesh credentials for {', '.join(regions)} in {Path(args.out).resolve()} (0600): the CA, "
          "the controller's, each balancer's and an admin client certificate, peer-token, admin-token; "
          "keep ca.key offline", file=sys.stderr)
    print(yaml.safe_dump({"tls": section}, sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m skymesh.security.pki_cli issue --config FILE --out DIR [--reuse | --force]``:
    ``skymesh pki`` without the ``skymesh`` command."""
    p = argparse.ArgumentParser(prog="python -m skymesh.security.pki_cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
