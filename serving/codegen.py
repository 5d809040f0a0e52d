"""Generates the Python stubs for serving/generation.proto (committed; tests check they are fresh).

    python -m serving.codegen [OUT_DIR]

Run from anywhere; writes serving/generation_pb2.py, generation_pb2.pyi and generation_pb2_grpc.py under
OUT_DIR (default: the repository root, i.e. next to the .proto). The proto is compiled with the repository root
as include path, so the generated modules import each other as ``serving.generation_pb2``.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "serving/generation.proto"
GENERATED = ("serving/generation_pb2.py", "serving/generation_pb2.pyi", "serving/generation_pb2_grpc.py")


def generate(out_dir: Path = ROOT) -> list[Path]:
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    (out_dir / "serving").mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                      f"--grpc_python_out={out_dir}", str(ROOT / PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")
    return [out_dir / name for name in GENERATED]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
