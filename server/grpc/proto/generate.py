"""Regenerate the Python modules of the gRPC protocol from the .proto files in this folder.

Run from anywhere with the project's environment: `python -m server.grpc.proto.generate`. The
modules are committed; tests/unit/server/grpc/test_proto.py regenerates them into a temporary
folder and fails when they differ, so an edited .proto cannot ship with stale code.

The output depends on the grpcio-tools release (it embeds the protobuf and grpcio versions it
targets); GENERATOR_VERSION records the release the committed files came from.
"""

from __future__ import annotations

import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path

from grpc_tools import protoc

GENERATOR_VERSION = "1.81.1"
"""grpcio-tools release that produced the committed modules."""

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parents[2]
PROTOS = ("model_config.proto", "grpc_service.proto")
SERVICE_PROTOS = ("grpc_service.proto",)


def generated_names() -> list[str]:
    """File names (in this folder) that `generate` writes."""
    names = []
    for proto in PROTOS:
        stem = proto.removesuffix(".proto")
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
    names += [f"{proto.removesuffix('.proto')}_pb2_grpc.py" for proto in SERVICE_PROTOS]
    return names


def _protoc(args: list[str]) -> None:
    include = str(resources.files("grpc_tools") / "_proto")
    code = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", *args])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules into `out_dir` (flat) and return their paths."""
    rel = [str(Path("server/grpc/proto") / proto) for proto in PROTOS]
    rel_service = [str(Path("server/grpc/proto") / proto) for proto in SERVICE_PROTOS]
    with tempfile.TemporaryDirectory() as tmp:
        # Paths relative to the project root make the generated imports package-qualified
        # (`from server.grpc.proto import model_config_pb2`) instead of top-level.
        _protoc([f"--python_out={tmp}", f"--pyi_out={tmp}", *rel])
        _protoc([f"--grpc_python_out={tmp}", *rel_service])
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in generated_names():
            target = out_dir / name
            text = (Path(tmp) / "server" / "grpc" / "proto" / name).read_text()
            target.write_text(_private_pool(text) if name.endswith("_pb2.py") else text)
            written.append(target)
    return written


def _private_pool(module: str) -> str:
    """The module registering its descriptors in sluice's own pool (server.grpc.proto.pool), not
    protobuf's default one, which tritonclient.grpc fills with the same `inference.*` names."""
    default = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
    imports = "# @@protoc_insertion_point(imports)\n"
    if module.count(default) != 1 or module.count(imports) != 1:
        raise RuntimeError("protoc's output changed shape; update _private_pool")
    module = module.replace(imports, imports + "from server.grpc.proto.pool import POOL\n")
    return module.replace(default, "DESCRIPTOR = POOL.AddSerializedFile(")


def main() -> int:
    installed = metadata.version("grpcio-tools")
    if installed != GENERATOR_VERSION:
        print(
            f"warning: grpcio-tools {installed} is installed; the committed modules came from "
            f"{GENERATOR_VERSION} (update GENERATOR_VERSION if you mean to switch)",
            file=sys.stderr,
        )
    for path in generate(PROTO_DIR):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
