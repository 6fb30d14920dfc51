"""Generate the Python stubs of `proto/pdserve/v1/*.proto`, reproducibly.

    python -m pdserve.proto.build            # regenerate in place (commit the result)
    python -m pdserve.proto.build --out DIR  # write elsewhere (the test compares)

Include paths are fixed: this folder (so files are named `pdserve/v1/<x>.proto` in the
descriptor pool and in reflection) and grpc_tools' bundled well-known types. protoc writes
imports as `from pdserve.v1 import x_pb2`; the one rewrite below turns them into
`from pdserve.proto.pdserve.v1 import x_pb2`, the package's real import path.
The output depends only on the .proto files and the grpcio-tools version
(GRPC_TOOLS_VERSION below; other versions stamp other version checks into the stubs).
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("pdserve") / "v1"
# The grpcio-tools version the committed stubs were generated with.
GRPC_TOOLS_VERSION = "1.85.1"

_IMPORT_RE = re.compile(rb"^from pdserve\.v1 import ", re.MULTILINE)
_IMPORT_FIXED = b"from pdserve.proto.pdserve.v1 import "
_GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_sources() -> list[Path]:
    """The .proto files, relative to PROTO_ROOT, sorted."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write the stubs under `out_root / pdserve/v1/`; returns the written paths, sorted."""
    from grpc_tools import protoc

    import grpc_tools

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    sources = proto_sources()
    if not sources:
        raise RuntimeError(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    with tempfile.TemporaryDirectory(prefix="pdserve-proto-") as tmp:
        args = ["grpc_tools.protoc", f"--proto_path={PROTO_ROOT}", f"--proto_path={well_known}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *(str(s) for s in sources)]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        written = []
        for generated in sorted((Path(tmp) / PACKAGE_DIR).iterdir()):
            if not generated.name.endswith(_GENERATED_SUFFIXES):
                continue
            target = out_root / PACKAGE_DIR / generated.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(_IMPORT_RE.sub(_IMPORT_FIXED, generated.read_bytes()))
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.proto.build", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: in place)")
    args = parser.parse_args(argv)
    import grpc_tools  # noqa: F401  (fail early with a clear message)
    from importlib.metadata import version

    found = version("grpcio-tools")
    if found != GRPC_TOOLS_VERSION:
        print(f"warning: grpcio-tools {found} != {GRPC_TOOLS_VERSION}; stubs will differ "
              "from the committed ones", file=sys.stderr)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
