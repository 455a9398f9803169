"""Regenerate the committed protobuf/gRPC modules from the .proto files.

`make proto` runs this. protoc's virtual include path (`-Ikvtier/proto=proto`)
makes the generated modules import each other as `kvtier.proto.*`, so they work
from the installed `kvtier` package without post-editing; `etcd/*.proto` (trimmed
copies of etcd's v3 API) land in `kvtier.proto.etcd` the same way. `--check`
regenerates into a temporary folder and fails when the committed files differ
(a test runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
# Paths relative to PROTO_DIR; a subfolder becomes a subpackage of kvtier.proto.
PROTO_FILES = ("status.proto", "master.proto", "etcd/kv.proto", "etcd/rpc.proto")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi")
# grpc_tools writes a `_pb2_grpc.py` for every .proto; only these declare services.
SERVICE_MODULES = ("master_pb2_grpc.py", "etcd/rpc_pb2_grpc.py")


def _generate(out_dir: Path) -> list[Path]:
    """Run protoc into `out_dir`; return the wanted modules as paths relative to the package."""
    from grpc_tools import protoc  # imported here: a dev dependency only

    args = [
        "protoc",
        f"-Ikvtier/proto={PROTO_DIR}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ] + [f"kvtier/proto/{name}" for name in PROTO_FILES]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = out_dir / "kvtier" / "proto"
    return sorted(
        rel
        for rel in (p.relative_to(generated) for p in generated.rglob("*") if p.is_file())
        if rel.name.endswith(GENERATED_SUFFIXES) or rel.as_posix() in SERVICE_MODULES
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed modules are stale")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generated = Path(tmp) / "kvtier" / "proto"
        stale = []
        for rel in _generate(Path(tmp)):
            src, dst = generated / rel, PROTO_DIR / rel
            if opts.check:
                if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
                    stale.append(rel.as_posix())
            else:
                shutil.copyfile(src, dst)
        if stale:
            print("stale generated modules (run `make proto`): " + ", ".join(stale), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
