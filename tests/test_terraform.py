"""Terraform, offline: fmt, `terraform test` per module (mock AWS provider from the local
filesystem mirror), the config module rendering a config skymesh accepts, and the dns
module applied against a Route53 emulator (moto) on loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import boto3
import pytest
import yaml

from skymesh.config import parse_config
from tests.mesh_helpers import ROOT

pytestmark = pytest.mark.timeout(600)

TF = shutil.which("terraform")
TF_DIR = ROOT / "terraform"
MIRRORS = [Path("/opt/tf-plugins"), Path.home() / ".terraform.d" / "plugins"]
MIRROR = next((m for m in MIRRORS if (m / "registry.terraform.io" / "hashicorp" / "aws").is_dir()), None)
needs_tf = pytest.mark.skipif(TF is None, reason="terraform is not installed on this machine")
needs_aws = pytest.mark.skipif(MIRROR is None, reason="no local filesystem mirror of the AWS provider")


@pytest.fixture(scope="module")
def tf_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tf")
    rc = d / "terraformrc"
    if MIRROR is not None:
        rc.write_text(
            'provider_installation {\n  filesystem_mirror {\n'
            f'    path    = "{MIRROR}"\n    include = ["registry.terraform.io/hashicorp/aws"]\n  }}\n}}\n'
        )
    else:
        rc.write_text("")
    return {**os.environ, "TF_CLI_CONFIG_FILE": str(rc), "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}


def tf(args: list[str], cwd: Path, env: dict[str, str], data_dir: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([TF or "terraform", *args], cwd=cwd, env={**env, "TF_DATA_DIR": str(data_dir)},
                         capture_output=True, text=True, timeout=300)
    if check and out.returncode != 0:
        raise AssertionError(f"terraform {' '.join(args)} failed in {cwd}:\n{out.stdout}\n{out.stderr}")
    return out


@needs_tf
def test_fmt(tf_env: dict[str, str], tmp_path: Path) -> None:
    out = tf(["fmt", "-check", "-recursive"], TF_DIR, tf_env, tmp_path, check=False)
    assert out.returncode == 0, f"run `terraform fmt -recursive terraform/`: {out.stdout}"


@needs_tf
def test_config_module_terraform_test(tf_env: dict[str, str], tmp_path: Path) -> None:
    mod = TF_DIR / "modules" / "config"
    tf(["init", "-backend=false", "-input=false"], mod, tf_env, tmp_path)
    out = tf(["test"], mod, tf_env, tmp_path)
    assert "7 passed, 0 failed" in out.stdout, out.stdout


@needs_tf
def test_config_module_output_feeds_skymesh(tf_env: dict[str, str], tmp_path: Path) -> None:
    work = tmp_path / "root"
    work.mkdir()
    (work / "main.tf").write_text(f'''
module "config" {{
  source        = "{TF_DIR / "modules" / "config"}"
  dns_name      = "llm.example.com"
  hosted_zone   = "example.com"
  controller_ip = "10.10.0.5"
  credentials_dir = "/etc/skymesh/pki"
  regions = [
    {{ name = "us-east-1", source_networks = ["10.10.0.0/16"], balancer_private_ip = "10.10.0.10", balancer_public_ip = "3.80.0.10", replica_ips = ["10.10.1.10", "10.10.1.11"] }},
    {{ name = "eu-west-1", source_networks = ["10.20.0.0/16"], balancer_private_ip = "10.20.0.10", replica_ips = ["10.20.1.10"] }},
  ]
  latencies = [{{ regions = ["us-east-1", "eu-west-1"], one_way_ms = 38 }}]
}}
output "skymesh_config" {{
  value     = module.config.skymesh_config
  sensitive = true
}}
''')
    tf(["init", "-backend=false", "-input=false"], work, tf_env, tmp_path / "d")
    tf(["apply", "-auto-approve", "-input=false"], work, tf_env, tmp_path / "d")
    yaml_text = tf(["output", "-raw", "skymesh_config"], work, tf_env, tmp_path / "d").stdout
    cfg = parse_config(yaml.safe_load(yaml_text))
    assert [r.name for r in cfg.regions] == ["us-east-1", "eu-west-1"]
    assert cfg.regions[0].replicas[1].url == "http://10.10.1.11:8000"
    assert cfg.regions[0].balancer.public_ip == "3.80.0.10"
    assert cfg.dns.provider == "route53" and cfg.rtt_ms("us-east-1", "eu-west-1") == 76
    # credentials_dir: tls names the files the secrets module's fetch scripts write, the
    # admin token is a file there, and no secret is in the config
    assert cfg.tls is not None and cfg.tls.ca_cert == "/etc/skymesh/pki/ca.crt"
    assert cfg.tls.balancers["eu-west-1"].key == "/etc/skymesh/pki/balancer-eu-west-1.key"
    assert cfg.tls.controller.cert == "/etc/skymesh/pki/controller.crt"
    assert cfg.admin.token_file == "/etc/skymesh/pki/admin-token" and cfg.peer_token is None


@needs_tf
@needs_aws
@pytest.mark.parametrize("module", ["dns", "region", "controller", "peering"])
def test_aws_modules_validate_and_test_with_mock_provider(module: str, tf_env: dict[str, str], tmp_path: Path) -> None:
    mod = TF_DIR / "modules" / module
    tf(["init", "-backend=false", "-input=false"], mod, tf_env, tmp_path)
    if module != "peering":
        # a module that takes aliased providers (configuration_aliases) cannot be validated
        # on its own; the example validates it in place and its tests plan it
        tf(["validate"], mod, tf_env, tmp_path)
    out = tf(["test"], mod, tf_env, tmp_path)
    assert " 0 failed" in out.stdout and "passed" in out.stdout, out.stdout


@needs_tf
@needs_aws
def test_example_validates_and_plans_with_mock_providers(tf_env: dict[str, str], tmp_path: Path) -> None:
    """No dependency cycle between Elastic IPs, the rendered config and the instances,
    and the config names the addresses the instances and records get."""
    ex = TF_DIR / "examples" / "three-regions"
    tf(["init", "-backend=false", "-input=false"], ex, tf_env, tmp_path)
    tf(["validate"], ex, tf_env, tmp_path)
    out = tf(["test"], ex, tf_env, tmp_path)
    assert "1 passed, 0 failed" in out.stdout, out.stdout




@needs_tf
@needs_aws
@pytest.mark.slow
def test_dns_module_apply_and_destroy_against_moto(tf_env: dict[str, str], tmp_path: Path, moto_url: str) -> None:
    work = tmp_path / "root"
    work.mkdir()
    (work / "main.tf").write_text(f'''
provider "aws" {{
  region                      = "us-east-1"
  access_key                  = "testing"
  secret_key                  = "testing"
  skip_credentials_validation = true
  skip_requesting_account_id  = true
  skip_metadata_api_check     = true
  skip_region_validation      = true
  endpoints {{
    route53 = "{moto_url}"
    sts     = "{moto_url}"
  }}
}}
module "dns" {{
  source      = "{TF_DIR / "modules" / "dns"}"
  zone_name   = "example.com"
  create_zone = true
  record_name = "llm.example.com"
  balancers = {{
    "us-east-1"      = {{ ip = "3.80.0.10" }}
    "eu-west-1"      = {{ ip = "52.16.0.10" }}
    "ap-northeast-1" = {{ ip = "13.112.0.10", port = 8080 }}
  }}
}}
output "zone_id" {{
  value = module.dns.zone_id
}}
''')
    env = {**tf_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    d = tmp_path / "d"
    tf(["init", "-backend=false", "-input=false"], work, env, d)
    tf(["apply", "-auto-approve", "-input=false"], work, env, d)
    zone_id = json.loads(tf(["output", "-json", "zone_id"], work, env, d).stdout)
    client = boto3.client("route53", endpoint_url=moto_url, region_name="us-east-1")
    sets = client.list_resource_record_sets(HostedZoneId=zone_id)["ResourceRecordSets"]
    recs = {r["SetIdentifier"]: r for r in sets if r.get("SetIdentifier")}
    assert set(recs) == {"skymesh-us-east-1", "skymesh-eu-west-1", "skymesh-ap-northeast-1"}
    checks = {c["Id"]: c["HealthCheckConfig"] for c in client.list_health_checks()["HealthChecks"]}
    for sid, rec in recs.items():
        assert rec["Region"] == sid.removeprefix("skymesh-")
        assert checks[rec["HealthCheckId"]]["IPAddress"] == rec["ResourceRecords"][0]["Value"]
    assert checks[recs["skymesh-ap-northeast-1"]["HealthCheckId"]]["Port"] == 8080
    # the controller's provider adopts what terraform made: nothing to change, nothing owned
    from skymesh.dns.base import BalancerEndpoint
    from skymesh.dns.route53 import Route53Provider

    provider = Route53Provider("example.com", "llm.example.com", ttl=30, endpoint_url=moto_url)
    eps = [BalancerEndpoint("us-east-1", "b1", "3.80.0.10", 8000, True),
           BalancerEndpoint("eu-west-1", "b2", "52.16.0.10", 8000, True),
           BalancerEndpoint("ap-northeast-1", "b3", "13.112.0.10", 8080, True)]
    assert provider.sync_blocking(eps) is False
    assert provider.changes_sent == 0 and provider.health_checks() == {}
    tf(["destroy", "-auto-approve", "-input=false"], work, env, d)
    assert client.list_health_checks()["HealthChecks"] == []
    assert all(z["Id"].split("/")[-1] != zone_id for z in client.list_hosted_zones()["HostedZones"])


CHECKOV_VENV = ROOT / ".venv-checkov"
CHECKOV_PIN = "checkov==3.3.30"


def checkov_bin() -> Path:
    """checkov lives in its own venv (its dependency tree conflicts with ours)."""
    exe = CHECKOV_VENV / "bin" / "checkov"
    stamp = CHECKOV_VENV / ".installed"
    if not stamp.exists() or stamp.read_text() != CHECKOV_PIN:
        subprocess.run(["python3", "-m", "venv", str(CHECKOV_VENV)], check=True, timeout=120)
        subprocess.run([str(CHECKOV_VENV / "bin" / "pip"), "install", "--quiet", CHECKOV_PIN], check=True,
                       timeout=900)
        stamp.write_text(CHECKOV_PIN)
    return exe


@pytest.mark.slow
def test_checkov_has_no_unjustified_failures() -> None:
    exe = checkov_bin()
    out = subprocess.run([str(exe), "-d", str(TF_DIR / "modules"), "--framework", "terraform", "--skip-download",
                          "--quiet", "--compact", "--output", "json"], capture_output=True, text=True, timeout=600)
    report = json.loads(out.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [c for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    assert not failed, [(c["check_id"], c["resource"], c["file_path"]) for c in failed]
    skipped = [c for r in reports for c in r.get("results", {}).get("skipped_checks", [])]
    # every skip carries a written justification in the module
    assert all(c.get("suppress_comment") for c in skipped), skipped
