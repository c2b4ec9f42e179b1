"""server.grpc.proto.generate: the committed protocol modules are what the .proto files
generate."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from server.grpc.proto import generate

# Lines that embed the generator's version (protobuf gencode and grpcio release).
_VERSION_LINES = (
    re.compile(rb"^# Protobuf Python Version: .*$", re.M),
    re.compile(rb"ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)", re.M),
    re.compile(rb"^GRPC_GENERATED_VERSION = .*$", re.M),
)


def _without_versions(text: bytes) -> bytes:
    for pattern in _VERSION_LINES:
        text = pattern.sub(b"<version>", text)
    return text


def test_regenerated_modules_match_committed(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(generate.generated_names())
    same_generator = metadata.version("grpcio-tools") == generate.GENERATOR_VERSION
    for path in written:
        fresh = path.read_bytes()
        committed = (generate.PROTO_DIR / path.name).read_bytes()
        if not same_generator:
            # Another grpcio-tools release only changes the embedded versions; compare the rest.
            fresh, committed = _without_versions(fresh), _without_versions(committed)
        assert fresh == committed, (
            f"{path.name} is stale: run `python -m server.grpc.proto.generate` "
            "and commit the result"
        )


def test_version_normalisation_removes_only_versions() -> None:
    committed = (generate.PROTO_DIR / "grpc_service_pb2_grpc.py").read_bytes()
    version = generate.GENERATOR_VERSION.encode()
    assert version in committed
    normalised = _without_versions(committed)
    assert version not in normalised
    assert b"class GRPCInferenceServiceServicer" in normalised
