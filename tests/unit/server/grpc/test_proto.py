"""The committed protocol modules match their .proto files, and the .proto files match the
protocol tritonclient speaks (names, field numbers, types)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from server.grpc.proto import generate, grpc_service_pb2, model_config_pb2

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


def _describe(files: list[descriptor_pb2.FileDescriptorProto]) -> dict[str, Any]:
    """{message full name: {field: [number, type, label, type_name]}, service: {rpc: [...]}}."""
    messages: dict[str, dict[str, list[Any]]] = {}
    enums: dict[str, dict[str, int]] = {}
    rpcs: dict[str, list[Any]] = {}

    def walk(prefix: str, msgs: Any, enum_types: Any) -> None:
        for enum in enum_types:
            enums[f"{prefix}.{enum.name}"] = {v.name: v.number for v in enum.value}
        for msg in msgs:
            full = f"{prefix}.{msg.name}"
            messages[full] = {
                f.name: [f.number, f.type, f.label, f.type_name.lstrip(".")] for f in msg.field
            }
            walk(full, msg.nested_type, msg.enum_type)

    for file in files:
        walk(file.package, file.message_type, file.enum_type)
        for service in file.service:
            for rpc in service.method:
                rpcs[f"{file.package}.{service.name}/{rpc.name}"] = [
                    rpc.input_type.lstrip("."),
                    rpc.output_type.lstrip("."),
                    rpc.client_streaming,
                    rpc.server_streaming,
                ]
    return {"messages": messages, "enums": enums, "rpcs": rpcs}


_TRITONCLIENT_DUMP = """
import json
from google.protobuf import descriptor_pb2
from tritonclient.grpc import model_config_pb2, service_pb2
files = []
for module in (model_config_pb2, service_pb2):
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    files.append(proto.SerializeToString().hex())
print(json.dumps(files))
"""


def _files(modules: tuple[Any, ...]) -> list[descriptor_pb2.FileDescriptorProto]:
    files = []
    for module in modules:
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        files.append(proto)
    return files


@pytest.fixture(scope="module")
def tritonclient_files() -> list[descriptor_pb2.FileDescriptorProto]:
    """tritonclient's [model_config, grpc_service] descriptors."""
    # tritonclient registers the same `inference.*` names in the default descriptor pool, so it
    # cannot be imported next to sluice's modules: read its descriptors in a child process.
    out = subprocess.run(
        [sys.executable, "-c", _TRITONCLIENT_DUMP],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [
        descriptor_pb2.FileDescriptorProto.FromString(bytes.fromhex(h)) for h in json.loads(out)
    ]


@pytest.fixture(scope="module")
def sluice_files() -> list[descriptor_pb2.FileDescriptorProto]:
    return _files((model_config_pb2, grpc_service_pb2))


def test_every_rpc_matches_tritonclient(
    sluice_files: list[descriptor_pb2.FileDescriptorProto],
    tritonclient_files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    ours, theirs = _describe(sluice_files)["rpcs"], _describe(tritonclient_files)["rpcs"]
    assert ours == theirs
    assert ours["inference.GRPCInferenceService/ModelInfer"] == [
        "inference.ModelInferRequest",
        "inference.ModelInferResponse",
        False,
        False,
    ]


def test_service_messages_match_tritonclient_exactly(
    sluice_files: list[descriptor_pb2.FileDescriptorProto],
    tritonclient_files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    # grpc_service.proto is kept whole: every message and field is Triton's, and nothing else.
    ours = _describe(sluice_files[1:])["messages"]
    theirs = _describe(tritonclient_files[1:])["messages"]
    assert sorted(ours) == sorted(theirs)
    for name, fields in theirs.items():
        assert ours[name] == fields, name
    assert ours["inference.ModelInferRequest"]["raw_input_contents"] == [7, 12, 3, ""]


def test_model_config_is_a_field_exact_subset(
    sluice_files: list[descriptor_pb2.FileDescriptorProto],
    tritonclient_files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    # model_config.proto is trimmed: what is left must be Triton's names and numbers.
    ours, theirs = _describe(sluice_files[:1]), _describe(tritonclient_files[:1])
    for name, fields in ours["messages"].items():
        assert name in theirs["messages"], f"{name} is not in Triton's model_config.proto"
        for field, spec in fields.items():
            assert theirs["messages"][name].get(field) == spec, f"{name}.{field}"
    for enum, values in ours["enums"].items():
        assert theirs["enums"][enum] == values, enum
    assert ours["messages"]["inference.ModelConfig"]["max_batch_size"] == [4, 5, 1, ""]
    assert ours["messages"]["inference.ModelConfig"]["dynamic_batching"][0] == 11


@pytest.mark.parametrize("first", ["sluice", "tritonclient"])
def test_sluice_and_tritonclient_protocol_modules_load_in_one_process(first: str) -> None:
    # Both define `inference.*`; in one descriptor pool the second import failed with
    # "duplicate symbol 'inference.DataType'". The bytes on the wire are the same.
    imports = {
        "sluice": "from server.grpc.proto import grpc_service_pb2 as ours",
        "tritonclient": "from tritonclient.grpc import service_pb2 as theirs",
    }
    second = imports["tritonclient" if first == "sluice" else "sluice"]
    code = f"""
{imports[first]}
{second}
import tritonclient.grpc.aio
request = dict(model_name="m", id="7")
print(ours.ModelInferRequest(**request).SerializeToString()
      == theirs.ModelInferRequest(**request).SerializeToString())
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
