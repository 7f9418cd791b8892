"""Generate the Python protobuf/gRPC modules from proto/swarm.proto.

Run by the build (setup.py), by `python -m swarm.wire.codegen`, or lazily by swarm.wire.protocol on
first import when the generated modules are missing or older than the .proto. The generated files
are build outputs: they are git-ignored and never edited by hand.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_PATH = ("swarm", "wire", "generated")
HASH_FILE = "proto.sha256"


def proto_digest(proto_file: Path) -> str:
    return hashlib.sha256(proto_file.read_bytes()).hexdigest()


def is_current(proto_file: Path, out_dir: Path) -> bool:
    digest_file = out_dir / HASH_FILE
    return (
        digest_file.exists()
        and (out_dir / "swarm_pb2.py").exists()
        and (out_dir / "swarm_pb2_grpc.py").exists()
        and digest_file.read_text().strip() == proto_digest(proto_file)
    )


def generate(proto_file: Path, out_dir: Path) -> None:
    """Compile `proto_file` into `out_dir` (a package importable as swarm.wire.generated)."""
    from grpc_tools import protoc

    proto_file = Path(proto_file).resolve()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes may start at once
        if is_current(proto_file, out_dir):
            return
        with tempfile.TemporaryDirectory() as tmp:
            # Place the .proto at swarm/wire/generated/ inside an include root, so that the
            # generated gRPC module imports `from swarm.wire.generated import swarm_pb2`.
            src_dir = Path(tmp, "src", *PACKAGE_PATH)
            src_dir.mkdir(parents=True)
            shutil.copy(proto_file, src_dir / "swarm.proto")
            build_dir = Path(tmp, "out")
            build_dir.mkdir()
            rel = "/".join(PACKAGE_PATH) + "/swarm.proto"
            grpc_include = Path(protoc.__file__).parent / "_proto"
            code = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"-I{tmp}/src",
                    f"-I{grpc_include}",
                    f"--python_out={build_dir}",
                    f"--grpc_python_out={build_dir}",
                    rel,
                ]
            )
            if code != 0:
                raise RuntimeError(f"protoc failed with exit code {code} on {proto_file}")
            for name in ("swarm_pb2.py", "swarm_pb2_grpc.py"):
                shutil.move(str(Path(build_dir, *PACKAGE_PATH, name)), out_dir / name)
        (out_dir / "__init__.py").write_text('"""Generated from proto/swarm.proto; do not edit."""\n')
        (out_dir / HASH_FILE).write_text(proto_digest(proto_file) + "\n")


def default_paths() -> tuple[Path, Path]:
    package_dir = Path(__file__).resolve().parent
    return package_dir.parents[1] / "proto" / "swarm.proto", package_dir / "generated"


def ensure_generated() -> None:
    """Generate the modules if the .proto is available and they are missing or stale."""
    proto_file, out_dir = default_paths()
    if proto_file.exists():
        if not is_current(proto_file, out_dir):
            generate(proto_file, out_dir)
    elif not (out_dir / "swarm_pb2.py").exists():
        raise RuntimeError(f"swarm's generated protobuf modules are missing and {proto_file} is not there")


if __name__ == "__main__":
    src, dst = default_paths()
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else src, Path(sys.argv[2]) if len(sys.argv) > 2 else dst)
    print(f"generated {dst} from {src}")
