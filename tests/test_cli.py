"""The `skymesh` command line as a new user meets it: every bench mode in `--help`, a
missing trace as one argparse line, and no traceback when the reader closes the pipe."""

from __future__ import annotations

import argparse
import fcntl
import importlib
import os
import subprocess
from pathlib import Path

import pytest

from skymesh.cli import main
from skymesh.runtime.procs import skymesh_cmd
from tests.mesh_helpers import ROOT


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def test_bench_help_lists_every_mode_with_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    from skymesh.bench.main import MODES

    for flag in ("--help", "-h"):
        code, out, _ = run_cli(capsys, "bench", flag)
        assert code == 0
        for mode, (_, help_text) in MODES.items():
            assert mode in out
            assert help_text.split()[0] in out
        assert {"trace", "routing", "proxy", "agree"} <= set(MODES)


def test_bench_without_a_mode_is_the_live_replay(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import skymesh.bench.live as live

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(live, "run", lambda args: seen.append(args) or 0)
    code, _, _ = run_cli(capsys, "bench", "--trace", str(trace), "--systems", "dualmap")
    assert code == 0 and seen[0].mode == "trace" and seen[0].trace == str(trace)
    # a mode's own help still works
    code, out, _ = run_cli(capsys, "bench", "routing", "--help")
    assert code == 0 and "--policies" in out


@pytest.mark.parametrize("argv", [
    ["sim", "--trace", "{missing}", "--systems", "dualmap"],
    ["bench", "--trace", "{missing}"],
    ["bench", "trace", "--trace", "{missing}"],
    ["bench", "agree", "--trace", "{missing}"],
])
def test_a_missing_trace_is_one_argparse_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]) -> None:
    missing = str(tmp_path / "no-such-trace.jsonl")
    code, out, err = run_cli(capsys, *(a.replace("{missing}", missing) for a in argv))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1, err  # the error alone, not the usage of every option
    assert err.startswith("skymesh ") and f": error: argument --trace: no trace file {missing} (" in err


@pytest.mark.parametrize(("module", "command", "instead"), [
    ("skymesh.bench.sim_setup", "sim", "hot-prefix"),  # a generated workload works instead
    # the live bench's parser leaves --trace unset (a --replot reads no trace); its run
    # checks the default as argparse would have
    ("skymesh.bench.live", "bench", ""),
])
def test_the_default_trace_missing_is_the_same_error(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        module: str, command: str, instead: str) -> None:
    missing = str(tmp_path / "shared" / "traces" / "mooncake_conversation.jsonl")
    monkeypatch.setattr(importlib.import_module(module), "DEFAULT_TRACE", missing)
    code, _, err = run_cli(capsys, command, "--systems", "dualmap")
    assert code == 2 and f"skymesh {command}: error: argument --trace: no trace file {missing}" in err
    assert instead in err


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """`skymesh config --schema | head -1`: a real pipe, small enough that the command
    is still writing when the reader has read one line and gone."""
    read_end, write_end = os.pipe()
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:
        pytest.skip("needs Linux's F_SETPIPE_SZ to make the schema outgrow the pipe")
    fcntl.fcntl(write_end, set_size, 4096)
    proc = subprocess.Popen(skymesh_cmd("config", "--schema"), cwd=ROOT, stdout=write_end,
                            stderr=subprocess.PIPE)
    os.close(write_end)
    with os.fdopen(read_end, "rb", buffering=0) as reader:
        first = b""
        while not first.endswith(b"\n"):
            first += reader.read(1)
    assert first == b"{\n"
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert err == b""
    assert proc.returncode == 1
