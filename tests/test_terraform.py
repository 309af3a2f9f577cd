"""Terraform, offline: fmt, `terraform test` per module (mock AWS provider from the local
filesystem mirror), the config module rendering a config skymesh accepts, and the dns
module applied against a Route53 emulator (moto) on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import grpc
import pytest
import yaml

from skymesh.config import parse_config
from skymesh.security.admin_auth import resolve_admin_token, resolve_peer_token
from skymesh.security.pki import (
    CONTROLLER_SERVER_NAME,
    Credentials,
    balancer_identity,
    balancer_server_name,
    generate_mesh_pki,
    load_credentials,
    peer_identity,
    secure_channel,
)
from skymesh.testing import checkov_env
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
    assert "16 passed, 0 failed" in out.stdout, out.stdout


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
    {{ name = "eu-west-1", source_networks = ["10.20.0.0/16"], balancer_private_ip = "10.20.0.10", replica_ips = [],
       replica_asg_names = ["skymesh-eu-west-1-replica"] }},
    {{ name = "eu-edge", aws_region = "eu-west-1", source_networks = ["10.21.0.0/16"], balancer_private_ip = "10.21.0.10",
       replica_ips = ["10.21.1.10"], replica_asg_names = ["skymesh-eu-edge-replica"] }},
  ]
  latencies = [{{ regions = ["us-east-1", "eu-west-1"], one_way_ms = 38 }}, {{ regions = ["us-east-1", "eu-edge"], one_way_ms = 40 }},
               {{ regions = ["eu-west-1", "eu-edge"], one_way_ms = 2 }}]
  autoscaling = {{ interval_s = 30 }}
  replica_discovery = {{ poll_interval_s = 10, drain_grace_s = 20 }}
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
    assert [r.name for r in cfg.regions] == ["us-east-1", "eu-west-1", "eu-edge"]
    # the balancers publish the signal the region module's replica scaling policy tracks
    # (its autoscaling_metric defaults: SkyMesh / PendingPrefillSecondsPerReplica)
    cw = cfg.autoscaling.cloudwatch
    assert cw is not None and (cw.namespace, cw.metric_name, cw.interval_s) == (
        "SkyMesh", "PendingPrefillSecondsPerReplica", 30.0)
    assert cfg.regions[0].replicas[1].url == "http://10.10.1.11:8000"
    assert cfg.regions[0].balancer.public_ip == "3.80.0.10"
    assert cfg.dns.provider == "route53" and cfg.rtt_ms("us-east-1", "eu-west-1") == 76
    # peers forward to each other's peer listener (mTLS), the port the region module opens
    eu = cfg.regions[1].balancer
    assert str(eu.peer_listen) == "0.0.0.0:8443" and str(eu.peer_advertise) == "10.20.0.10:8443"
    # credentials_dir: tls names the files the secrets module's fetch scripts write, the
    # admin token is a file there, and no secret is in the config
    assert cfg.tls is not None and cfg.tls.ca_cert == "/etc/skymesh/pki/ca.crt"
    assert cfg.tls.balancers["eu-west-1"].key == "/etc/skymesh/pki/balancer-eu-west-1.key"
    assert cfg.tls.controller.cert == "/etc/skymesh/pki/controller.crt"
    assert cfg.admin.token_file == "/etc/skymesh/pki/admin-token" and cfg.peer_token is None
    # the replica groups: one AWS source for eu-west-1 (both mesh regions there), each
    # group's instances replicas of their own mesh region; eu-west-1 lists no static
    # replica, which the config accepts because its group adds some
    m = cfg.membership
    assert m.drain_grace_s == 20 and not m.registration.enabled and len(m.aws) == 1
    src = m.aws[0]
    assert (src.aws_region, src.port, src.scheme, src.poll_interval_s, src.tag_key) == ("eu-west-1", 8000, "http", 10.0, None)
    assert [(g.name, g.region) for g in src.auto_scaling_groups] == [
        ("skymesh-eu-west-1-replica", "eu-west-1"), ("skymesh-eu-edge-replica", "eu-edge")]
    assert cfg.regions[1].replicas == () and m.can_add_to("eu-west-1") and not m.can_add_to("us-east-1")


@needs_tf
@needs_aws
@pytest.mark.parametrize("module", ["dns", "region", "controller", "peering", "secrets"])
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
    assert "5 passed, 0 failed" in out.stdout, out.stdout




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


# ----------------------------------------------------------------------------- secrets on moto

SECRET_REGIONS = ["us-east-1", "eu-west-1"]
AWS_CLI = shutil.which("aws")


@dataclass
class AppliedSecrets:
    """The secrets module (and the config module naming the files it fetches) applied
    against a Secrets Manager emulator (moto) on loopback, from `skymesh pki issue` files."""

    url: str
    env: dict[str, str]  # terraform's, with the emulator's test credentials
    work: Path  # the root module
    data_dir: Path
    pki: Path  # what `skymesh pki issue` wrote
    host: Path  # the instances' credentials_dir
    outputs: dict[str, Any]

    def client(self) -> Any:
        return boto3.client("secretsmanager", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def apply(self) -> None:
        tf(["apply", "-auto-approve", "-input=false"], self.work, self.env, self.data_dir)
        out = tf(["output", "-json"], self.work, self.env, self.data_dir).stdout
        self.outputs = {k: v["value"] for k, v in json.loads(out).items()}


def secrets_root(url: str, pki: Path, host: Path) -> str:
    return f"""
provider "aws" {{
  region                      = "us-east-1"
  access_key                  = "testing"
  secret_key                  = "testing"
  skip_credentials_validation = true
  skip_requesting_account_id  = true
  skip_metadata_api_check     = true
  skip_region_validation      = true
  endpoints {{
    secretsmanager = "{url}"
    sts            = "{url}"
  }}
}}
locals {{
  pki     = "{pki}"
  regions = {json.dumps(SECRET_REGIONS)}
}}
# what terraform/examples/three-regions does with var.credentials_dir
module "secrets" {{
  source     = "{TF_DIR / "modules" / "secrets"}"
  regions    = local.regions
  ca_cert    = file("${{local.pki}}/ca.crt")
  controller = {{ cert = file("${{local.pki}}/controller.crt"), key = file("${{local.pki}}/controller.key") }}
  balancers = {{ for r in local.regions : r => {{
    cert = file("${{local.pki}}/balancer-${{r}}.crt")
    key  = file("${{local.pki}}/balancer-${{r}}.key")
  }} }}
  peer_token              = file("${{local.pki}}/peer-token")
  admin_token             = file("${{local.pki}}/admin-token")
  recovery_window_in_days = 0
  host_dir                = "{host}"
}}
module "config" {{
  source          = "{TF_DIR / "modules" / "config"}"
  dns_name        = "llm.example.com"
  hosted_zone     = "example.com"
  controller_ip   = "10.10.0.5"
  credentials_dir = module.secrets.host_dir
  regions = [
    {{ name = "us-east-1", source_networks = ["10.10.0.0/16"], balancer_private_ip = "10.10.0.10", replica_ips = ["10.10.1.10"] }},
    {{ name = "eu-west-1", source_networks = ["10.20.0.0/16"], balancer_private_ip = "10.20.0.10", replica_ips = ["10.20.1.10"] }},
  ]
  latencies = [{{ regions = ["us-east-1", "eu-west-1"], one_way_ms = 38 }}]
}}
output "secret_arns" {{
  value = module.secrets.secret_arns
}}
output "balancers" {{
  value = module.secrets.balancers
}}
output "controller" {{
  value = module.secrets.controller
}}
output "skymesh_config" {{
  value     = module.config.skymesh_config
  sensitive = true
}}
"""


@pytest.fixture(scope="module")
def applied_secrets(tf_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppliedSecrets]:
    from moto.server import ThreadedMotoServer

    from skymesh.security.pki_cli import issue

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host_ip, port = server.get_host_and_port()
        url = f"http://{host_ip}:{port}"
        tmp = tmp_path_factory.mktemp("secrets")
        pki, host, work = tmp / "pki", tmp / "host", tmp / "root"
        issue(pki, SECRET_REGIONS)  # what `skymesh pki issue --out pki` writes
        work.mkdir()
        (work / "main.tf").write_text(secrets_root(url, pki, host))
        env = {**tf_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        applied = AppliedSecrets(url, env, work, tmp / "d", pki, host, {})
        tf(["init", "-backend=false", "-input=false"], work, env, applied.data_dir)
        applied.apply()
        yield applied
        tf(["destroy", "-auto-approve", "-input=false"], work, env, applied.data_dir)
        assert applied.client().list_secrets()["SecretList"] == []
    finally:
        server.stop()


def stored_values(applied: AppliedSecrets) -> dict[str, str]:
    """What each secret should hold: the files of `skymesh pki issue`."""
    pki = applied.pki

    def pair(name: str) -> str:
        return json.dumps({"cert": (pki / f"{name}.crt").read_text(), "key": (pki / f"{name}.key").read_text()})

    return {
        "ca-cert": (pki / "ca.crt").read_text(),
        "peer-token": (pki / "peer-token").read_text().strip(),
        "admin-token": (pki / "admin-token").read_text().strip(),
        "controller": pair("controller"),
        **{f"balancer/{r}": pair(f"balancer-{r}") for r in SECRET_REGIONS},
    }


@needs_tf
@needs_aws
@pytest.mark.slow
def test_secrets_module_stores_each_component_apart_and_nothing_in_state(applied_secrets: AppliedSecrets) -> None:
    applied = applied_secrets
    client = applied.client()
    expected = stored_values(applied)
    names = {s["Name"]: s["ARN"] for s in client.list_secrets()["SecretList"]}
    assert names == {f"skymesh/{k}": applied.outputs["secret_arns"][k] for k in expected}
    for key, value in expected.items():
        got = client.get_secret_value(SecretId=applied.outputs["secret_arns"][key])["SecretString"]
        if key in ("controller",) or key.startswith("balancer/"):
            assert json.loads(got) == json.loads(value), key
        else:
            assert got == value, key
    # write-only: no value in the state or in the (non-sensitive) outputs
    state = (applied.work / "terraform.tfstate").read_text()
    outputs = json.dumps({k: v for k, v in applied.outputs.items() if k != "skymesh_config"})
    for text in (state, outputs, applied.outputs["skymesh_config"]):
        assert "PRIVATE KEY" not in text and "BEGIN CERTIFICATE" not in text
        assert expected["peer-token"] not in text and expected["admin-token"] not in text
    # rotation: a re-issued token is uploaded by the next apply, the old one stays AWSPREVIOUS
    old = expected["peer-token"]
    (applied.pki / "peer-token").write_text("rotated-" + old[8:] + "\n")
    applied.apply()
    peer_arn = applied.outputs["secret_arns"]["peer-token"]
    assert client.get_secret_value(SecretId=peer_arn)["SecretString"] == "rotated-" + old[8:]
    assert client.get_secret_value(SecretId=peer_arn, VersionStage="AWSPREVIOUS")["SecretString"] == old
    plan = tf(["plan", "-detailed-exitcode", "-input=false"], applied.work, applied.env, applied.data_dir, check=False)
    assert plan.returncode == 0, plan.stdout  # nothing changed: nothing to upload


def write_like_the_fetch_script(applied: AppliedSecrets, component: str) -> None:
    """Without the AWS CLI here: the host files the fetch script writes, from boto3 reads."""
    client, arns, host = applied.client(), applied.outputs["secret_arns"], applied.host

    def get(key: str) -> str:
        return str(client.get_secret_value(SecretId=arns[key])["SecretString"])

    host.mkdir(mode=0o700, exist_ok=True)
    files = {"ca.crt": get("ca-cert").rstrip("\n") + "\n"}
    name, key = ("controller", "controller") if component == "controller" else (f"balancer-{component}",
                                                                                  f"balancer/{component}")
    pair = json.loads(get(key))
    files |= {f"{name}.crt": pair["cert"], f"{name}.key": pair["key"]}
    if component == "controller":
        files["admin-token"] = get("admin-token") + "\n"
    else:
        files["peer-token.env"] = f"SKYMESH_PEER_TOKEN={get('peer-token')}\n"
    for fname, text in files.items():
        fd = os.open(host / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)


def fetch_on_host(applied: AppliedSecrets, component: str, tmp_path: Path) -> None:
    """One instance's boot: its fetch script (with the AWS CLI, against the emulator)."""
    if AWS_CLI is None:
        warnings.warn("no AWS CLI here: the fetch scripts did not run, their files were written from boto3 reads",
                      stacklevel=2)
        write_like_the_fetch_script(applied, component)
        return
    entry = applied.outputs["controller"] if component == "controller" else applied.outputs["balancers"][component]
    script = tmp_path / f"fetch-{component}.sh"
    script.write_text(entry["fetch_script"])
    env = {**os.environ, "AWS_ENDPOINT_URL": applied.url, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


async def whoami(server: Credentials, client: Credentials, server_name: str) -> str:
    """An mTLS call with skymesh.security.pki's credentials: the identity the server verified."""
    srv = grpc.aio.server()

    def handler(request: bytes, context: Any) -> bytes:
        return (peer_identity(context) or "").encode()

    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "skymesh.test.WhoAmI", {"Call": grpc.unary_unary_rpc_method_handler(handler)}),))
    port = srv.add_secure_port("127.0.0.1:0", server.server_credentials())
    await srv.start()
    try:
        async with secure_channel(f"127.0.0.1:{port}", client, server_name) as channel:
            reply = await channel.unary_unary("/skymesh.test.WhoAmI/Call")(b"", timeout=10)
        return bytes(reply).decode()
    finally:
        await srv.stop(None)


@needs_tf
@needs_aws
@pytest.mark.slow
def test_fetched_credentials_make_an_mtls_mesh(applied_secrets: AppliedSecrets, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each host fetches only its files (0600 in a 0700 directory) to the paths the
    rendered config names; the config validates, the loader reads them, the tokens resolve
    as the daemons resolve them, and the pairs complete mTLS handshakes under the CA."""
    applied = applied_secrets
    cfg = parse_config(yaml.safe_load(applied.outputs["skymesh_config"]))
    assert cfg.tls is not None and Path(cfg.tls.ca_cert) == applied.host / "ca.crt"
    creds: dict[str, Credentials] = {}
    for component in [*SECRET_REGIONS, "controller"]:
        shutil.rmtree(applied.host, ignore_errors=True)  # a fresh instance
        fetch_on_host(applied, component, tmp_path)
        own = ["controller.crt", "controller.key", "admin-token"] if component == "controller" else [
            f"balancer-{component}.crt", f"balancer-{component}.key", "peer-token.env"]
        assert sorted(p.name for p in applied.host.iterdir()) == sorted(["ca.crt", *own]), component
        assert stat.S_IMODE(applied.host.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in applied.host.iterdir())
        loaded = load_credentials(cfg, component)
        assert loaded is not None
        creds[component] = loaded
        if component == "controller":
            monkeypatch.delenv(cfg.admin.token_env, raising=False)
            assert resolve_admin_token(cfg, state_dir=None) == (applied.pki / "admin-token").read_text().strip()
        else:
            # systemd's EnvironmentFile=: the balancer sees SKYMESH_PEER_TOKEN
            name, _, value = (applied.host / "peer-token.env").read_text().strip().partition("=")
            monkeypatch.setenv(name, value)
            # a balancer listening beyond loopback (a documentation address)
            assert resolve_peer_token(cfg, ("192.0.2.10",), state_dir=None) == (
                applied.pki / "peer-token").read_text().strip()
    shutil.rmtree(applied.host)
    rogue = generate_mesh_pki(tmp_path / "rogue", ["eu-west-1"])["balancers"]["eu-west-1"]
    forged = Credentials(creds["eu-west-1"].ca_pem, Path(rogue["cert"]).read_bytes(), Path(rogue["key"]).read_bytes())
    asyncio.run(handshakes(creds, forged))


async def handshakes(creds: dict[str, Credentials], forged: Credentials) -> None:
    # a balancer dials the controller; balancers dial each other (the dialed name is pinned)
    assert await whoami(creds["controller"], creds["eu-west-1"], CONTROLLER_SERVER_NAME) == balancer_identity("eu-west-1")
    assert await whoami(creds["us-east-1"], creds["eu-west-1"], balancer_server_name("us-east-1")) == \
        balancer_identity("eu-west-1")
    with pytest.raises(grpc.aio.AioRpcError):  # us-east-1's certificate does not answer for eu-west-1
        await whoami(creds["us-east-1"], creds["eu-west-1"], balancer_server_name("eu-west-1"))
    with pytest.raises(grpc.aio.AioRpcError):  # a certificate from another CA is refused
        await whoami(creds["controller"], forged, CONTROLLER_SERVER_NAME)

def checkov_bin() -> Path:
    """checkov lives in its own venv, built by `make checkov-env` (never by a test): skip
    with the reason when it is not there."""
    reason = checkov_env.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return checkov_env.checkov_bin()


@pytest.mark.fault
def test_the_checkov_venv_is_found_or_the_reason_given_without_installing(tmp_path: Path) -> None:
    venv = tmp_path / "venv-checkov"
    assert "make checkov-env" in (checkov_env.unavailable_reason(venv) or "")
    assert not venv.exists()  # asking never builds
    venv.mkdir()
    # the marker a failed `make checkov-env` leaves (its summary line, then the log's tail)
    summary = "the checkov build step failed (exit 1); log: x"
    (venv / "build-failed").write_text(f"{summary}\nno index\n")
    reason = checkov_env.unavailable_reason(venv) or ""
    assert "could not be built" in reason and summary in reason
    (venv / "bin").mkdir()
    (venv / "bin" / "checkov").write_text("")
    (venv / ".installed").write_text("checkov==3.0.0")  # another pin: not this one
    assert checkov_env.unavailable_reason(venv) is not None
    (venv / ".installed").write_text(checkov_env.CHECKOV_PIN)
    assert checkov_env.unavailable_reason(venv) is None
    assert checkov_env.checkov_bin(venv) == venv / "bin" / "checkov"


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
