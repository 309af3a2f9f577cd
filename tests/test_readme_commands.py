"""README.md's commands run as printed: every command line of its ```sh blocks is either
run here through bash from the repository root, against the mesh `make run` starts (the
Makefile's `run` recipe, on the embedded default's own ports, with the admin token in
.skymesh/run/ as a newcomer's shell has it), or listed in NOT_RUN with the reason. A
command README gains that is in neither fails the check, so README cannot drift from
what works. Also: README links every docs/*.md, its relative links resolve, and it stays
within two screens."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from skymesh.config import MeshConfig, load_config
from skymesh.operations.up import Mesh
from skymesh.runtime.procs import bind_problem, describe_port_holders, skymesh_cmd
from tests.mesh_helpers import ROOT

README = ROOT / "README.md"
README_MAX_LINES = 150
REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1"]

# README command lines not run here, each with the reason (the line exactly as printed)
NOT_RUN: dict[str, str] = {
    "make run    # the embedded default: the local 3-region mesh (controller, DNS, balancers, stand-in replicas)":
        "runs until Ctrl-C; test_the_first_five_minutes starts what it starts (the Makefile's `run` "
        "recipe after `make setup`) and runs README's client commands against it",
    "make run-fleet  # the same mesh with two active-active balancers per region behind each entry "
    "(configs/local-fleet.yaml)":
        "runs until Ctrl-C, on the same ports as `make run`; a fleet of the same mesh is started and "
        "queried through its entries in tests/test_fleet.py",
    "make test   # every test (unit, property, integration with real processes on loopback, terraform)":
        "the suite itself, this test included",
}


def readme_commands(text: str) -> list[str]:
    """The command lines of the ```sh blocks, a backslash-continued line joined with the
    next (as bash reads it); blank lines and whole-line comments are not commands."""
    commands: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        pending = ""
        for line in block.splitlines():
            if line.endswith("\\"):
                pending += line[:-1].rstrip() + " "
                continue
            command = (pending + line.strip()).strip()
            pending = ""
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def shell(command: str) -> subprocess.CompletedProcess[str]:
    """``command`` through bash from the repository root, as a reader types it."""
    return subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=120)


def region_of(cfg: MeshConfig, address: str) -> str:
    ip = ipaddress.ip_address(address)
    return next(r.name for r in cfg.regions if any(ip in net for net in r.source_networks))


def check_status(cfg: MeshConfig, command: str, out: subprocess.CompletedProcess[str]) -> None:
    assert "regions: 3/3 healthy" in out.stdout, out.stdout
    for region in REGIONS:
        assert f"== {region}  balancer up  {cfg.region(region).balancer.advertise_url}" in out.stdout, out.stdout


def check_resolve(cfg: MeshConfig, command: str, out: subprocess.CompletedProcess[str]) -> None:
    source = re.search(r"--source (\S+)", command)
    assert source is not None, command
    region = region_of(cfg, source.group(1))
    balancer = cfg.region(region).balancer
    assert region == "eu-west-1"  # README's example client
    assert f"client {source.group(1)}: a client of {region}" in out.stdout, out.stdout
    assert f"IN A {balancer.advertise.host}   -> the balancer of {region} ({balancer.advertise_url})" in out.stdout


def check_completion(cfg: MeshConfig, command: str, out: subprocess.CompletedProcess[str]) -> None:
    asked = json.loads(re.search(r"-d '(\{.*\})'", command).group(1))  # type: ignore[union-attr]
    answer = json.loads(out.stdout)
    assert answer["object"] == "text_completion" and answer["model"] == cfg.model == asked["model"]
    assert answer["id"].startswith("cmpl-")
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "length" and choice["text"].strip()
    assert answer["usage"]["completion_tokens"] == asked["max_tokens"]
    assert answer["usage"]["prompt_tokens"] > 0


def check_controller_api(cfg: MeshConfig, command: str, out: subprocess.CompletedProcess[str]) -> None:
    status = json.loads(out.stdout)
    assert status["source"] == "controller" and status["policy"] == cfg.policy.name
    assert [r["region"] for r in status["regions"]] == REGIONS
    assert all(r["balancer_alive"] for r in status["regions"])


Check = Callable[[MeshConfig, str, subprocess.CompletedProcess[str]], None]
# README commands run against `make run`'s mesh: the first pattern a command matches
# (re.search) names what its output must show
RUN: list[tuple[str, Check]] = [
    (r"^\.venv/bin/skymesh status(\s|$)", check_status),
    (r"^\.venv/bin/skymesh resolve ", check_resolve),
    (r"^curl .*/v1/completions ", check_completion),
    (r"^curl .*Authorization: Bearer \$\(cat \.skymesh/run/admin-token\)\" http://127\.0\.0\.1:7002/v1/status",
     check_controller_api),
]


def check_of(command: str) -> Check | None:
    return next((check for pattern, check in RUN if re.search(pattern, command)), None)


def test_readme_commands_are_parsed_as_bash_reads_them() -> None:
    text = "```sh\na --x \\\n  --y 'z w'   # note\n# a comment\n\nb\n```\n```\nnot sh\n```\n```sh\nc\n```\n"
    assert readme_commands(text) == ["a --x --y 'z w'   # note", "b", "c"]


def test_every_readme_command_is_run_here_or_listed_with_a_reason() -> None:
    commands = readme_commands(README.read_text())
    neither = [c for c in commands if c not in NOT_RUN and check_of(c) is None]
    assert neither == [], ("README commands neither run by test_the_first_five_minutes (RUN) nor listed "
                           f"in NOT_RUN with a reason: {neither}")
    assert [c for c in NOT_RUN if c not in commands] == [], "NOT_RUN lists a command README no longer prints"
    assert [p for p, check in RUN if not any(check_of(c) is check for c in commands)] == [], \
        "a RUN pattern matches no README command"


def test_readme_links_every_doc_and_its_links_resolve() -> None:
    text = README.read_text()
    targets = {t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)
               if not re.match(r"[a-z]+:|#", t)}
    docs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert [d for d in docs if d not in targets] == [], "docs/*.md not linked from README"
    assert sorted(t for t in targets if not (ROOT / t).is_file()) == [], "README links to files that do not exist"


def test_readme_fits_on_two_screens() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def make_run_argv() -> list[str]:
    """The Makefile's `run` recipe as a `skymesh` command line (its `$(BIN)/skymesh`
    is this interpreter's skymesh)."""
    recipe = re.search(r"^run:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert recipe is not None, "no `run` recipe in the Makefile"
    words = shlex.split(recipe.group(1))
    assert words[0] == "$(BIN)/skymesh", recipe.group(1)
    return skymesh_cmd(*words[1:])


def fail_on_taken_ports(argv: list[str], tmp_path: Path) -> None:
    """The default mesh's addresses must be free (a clean machine): say which is not."""
    config = argv[argv.index("--config") + 1]
    mesh = Mesh(ROOT / config, tmp_path / "preflight")
    taken = [f"{what} {host}:{port} ({why} {describe_port_holders(host, port, udp)})"
             for what, host, port, udp in mesh.listen_addresses()
             if (why := bind_problem(host, port, udp)) is not None]
    if taken:
        pytest.fail("README's commands run against `make run`'s mesh on its default ports; taken: "
                    + "; ".join(taken))


def wait_until_healthy(up: subprocess.Popen[str], log_path: Path) -> None:
    """Until `skymesh up` printed its ready line and every region reports three healthy
    replicas (a balancer's first report may come before its first probe)."""
    while "skymesh is up" not in log_path.read_text():
        assert up.poll() is None, log_path.read_text()
        time.sleep(0.2)
    while True:
        out = subprocess.run(skymesh_cmd("status", "--json"), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        regions = json.loads(out.stdout)["regions"]
        if all(r.get("report") and len(r["report"]["replicas"]) == 3
               and all(x["healthy"] for x in r["report"]["replicas"].values()) for r in regions):
            return
        time.sleep(0.3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_first_five_minutes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not (ROOT / ".venv" / "bin" / "skymesh").is_file():
        pytest.fail("README's commands run .venv/bin/skymesh: `make setup` creates it")
    # a newcomer's shell: no tokens in the environment, so `skymesh up` keeps its admin
    # token in .skymesh/run/admin-token, where README's curl line reads it
    monkeypatch.delenv("SKYMESH_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("SKYMESH_PEER_TOKEN", raising=False)
    argv = make_run_argv()
    fail_on_taken_ports(argv, tmp_path)
    cfg = load_config(ROOT / argv[argv.index("--config") + 1])
    commands = [c for c in readme_commands(README.read_text()) if c not in NOT_RUN]
    log_path = tmp_path / "make-run.log"
    with open(log_path, "w") as log:
        up = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env=dict(os.environ))
    try:
        wait_until_healthy(up, log_path)
        for command in commands:
            check = check_of(command)
            assert check is not None, command
            out = shell(command)
            assert out.returncode == 0, f"{command}\n{out.stdout}\n{out.stderr}"
            check(cfg, command, out)
    finally:
        if up.poll() is None:
            os.kill(up.pid, signal.SIGINT)  # Ctrl-C, as `make run` is stopped
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(up.pid, signal.SIGKILL)
            up.wait()
    assert up.returncode == 0, log_path.read_text()
    assert "stopped." in log_path.read_text()
