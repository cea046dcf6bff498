"""Regenerate the Python gRPC code from proto/ (run from anywhere: ``python scripts/gen_proto.py [--out DIR]``).

The generated files are committed; tests/test_proto.py regenerates into a temporary folder and checks that
the committed files are identical, so the contract and the code never drift. grpcio-tools is pinned in the
``dev`` extra and ``grpcio``/``protobuf`` at or above its versions in ``serve``: generated code refuses an older
runtime.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "proto"
PROTO_FILES = ["elmo/v1/embedder.proto"]


def generate(out_dir: Path) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every proto file under ``out_dir``."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO_FILES}")
    written = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        written += [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2.pyi", out_dir / f"{stem}_pb2_grpc.py"]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO, help="output root (default: the repo, next to elmo/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
