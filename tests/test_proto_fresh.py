"""The committed generated code matches what the pinned grpcio-tools makes of proto/."""

from __future__ import annotations

from pathlib import Path

from skymesh.runtime.proto_build import DEFAULT_OUT, generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    fresh = {p.name: p.read_text() for p in generate(out)}
    committed = {p.name: p.read_text() for p in DEFAULT_OUT.glob("*.py")}
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"regenerate with `make proto`: {stale} differ from proto/"
