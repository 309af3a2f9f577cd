"""Regenerate the committed gRPC/protobuf code: `python -m skymesh.runtime.proto_build [--out DIR]`.

The generated modules are committed (skymesh/proto_gen/) so a fresh clone needs no
codegen step; tests/test_proto_fresh.py regenerates into a temporary folder with the
pinned grpcio-tools and fails on any difference.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PROTOS = ["skymesh/v1/mesh.proto"]
DEFAULT_OUT = ROOT / "skymesh" / "proto_gen"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    raw = out / "_raw"
    raw.mkdir(exist_ok=True)
    for proto in PROTOS:
        rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={raw}", f"--grpc_python_out={raw}",
                          str(PROTO_DIR / proto)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
    written = []
    for src in sorted(raw.rglob("*.py")):
        text = src.read_text()
        # generated code imports `skymesh.v1.mesh_pb2`; it lives in skymesh.proto_gen
        text = re.sub(r"^from skymesh\.v1 import", "from skymesh.proto_gen import", text, flags=re.M)
        dst = out / src.name
        dst.write_text(text)
        written.append(dst)
        src.unlink()
    for d in sorted(raw.rglob("*"), reverse=True):
        d.rmdir()
    raw.rmdir()
    init = out / "__init__.py"
    init.write_text('"""Generated from proto/ by `python -m skymesh.runtime.proto_build`; do not edit."""\n')
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    for p in generate(args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
