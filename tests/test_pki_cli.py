"""`skymesh pki issue`: the mesh credentials of a config, offline (CA, every component's
certificate, peer and admin tokens), never overwriting unless asked."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from skymesh.config import parse_config
from skymesh.security.pki import balancer_identity, balancer_server_name, load_credentials
from skymesh.security.pki_cli import IssueError, credential_files, issue
from tests.mesh_helpers import ROOT, local_config_free_ports

REGIONS = ["us-east-1", "eu-west-1"]


def write_config(tmp_path: Path) -> Path:
    data = local_config_free_ports()
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def skymesh(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skymesh.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def san_of(cert_path: Path) -> tuple[list[str], list[str]]:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier), san.get_values_for_type(x509.DNSName)


def verify_signed_by(cert_path: Path, ca_path: Path) -> None:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_path.read_bytes()))  # raises on a wrong issuer or signature


def test_cli_issues_every_file_private_and_prints_the_tls_section(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path)
    out = tmp_path / "pki"
    res = skymesh("pki", "issue", "--config", str(cfg_path), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    data = yaml.safe_load(cfg_path.read_text())
    regions = [r["name"] for r in data["regions"]]
    assert sorted(p.name for p in out.iterdir()) == sorted(credential_files(regions))
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    for r in regions:
        uris, dns = san_of(out / f"balancer-{r}.crt")
        assert uris == [balancer_identity(r)] and dns == [balancer_server_name(r)]
        verify_signed_by(out / f"balancer-{r}.crt", out / "ca.crt")
    assert san_of(out / "controller.crt") == (["spiffe://skymesh/controller"], ["controller.skymesh"])
    peer, admin = ((out / n).read_text().strip() for n in ("peer-token", "admin-token"))
    assert len(peer) >= 40 and len(admin) >= 40 and peer != admin
    # the printed section is a tls: section the config accepts and the loader reads
    data["tls"] = yaml.safe_load(res.stdout)["tls"]
    cfg = parse_config(data)
    for component in [*regions, "controller", "admin"]:
        assert load_credentials(cfg, component) is not None


def test_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    issue(out, REGIONS)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(IssueError, match="refusing to overwrite"):
        issue(out, REGIONS)
    cfg_path = write_config(tmp_path)
    res = skymesh("pki", "issue", "--config", str(cfg_path), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 1 and "refusing to overwrite" in res.stderr and res.stdout == ""
    # python -m skymesh.security.pki_cli is the same command
    res = subprocess.run([sys.executable, "-m", "skymesh.security.pki_cli", "issue", "--config", str(cfg_path),
                          "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "refusing to overwrite" in res.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before


def test_reuse_keeps_the_ca_and_adds_a_region(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    issue(out, ["us-east-1"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    issue(out, ["us-east-1", "eu-west-1"], mode="reuse")
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {k: after[k] for k in before} == before  # nothing replaced, tokens included
    verify_signed_by(out / "balancer-eu-west-1.crt", out / "ca.crt")


def test_reuse_refuses_half_a_ca(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    issue(out, REGIONS)
    (out / "ca.key").unlink()  # the CA key was moved offline, as the docs say
    leaf = (out / "balancer-us-east-1.key").read_bytes()
    with pytest.raises(IssueError, match="ca.key is missing"):
        issue(out, REGIONS, mode="reuse")
    assert (out / "balancer-us-east-1.key").read_bytes() == leaf


def test_force_replaces_everything(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    issue(out, REGIONS)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    issue(out, REGIONS, mode="force")
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(after) == set(before)
    assert all(after[n] != before[n] for n in before), [n for n in before if after[n] == before[n]]
    verify_signed_by(out / "controller.crt", out / "ca.crt")


def test_bad_config_is_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("regions: []\n")
    res = skymesh("pki", "issue", "--config", str(bad), "--out", str(tmp_path / "pki"), cwd=tmp_path)
    assert res.returncode == 2 and "config error" in res.stderr
    assert not (tmp_path / "pki").exists()
