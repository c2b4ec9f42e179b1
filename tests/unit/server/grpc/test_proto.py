"""The .proto files match the protocol tritonclient speaks (names, field numbers, types).
(proto/test_generate.py: the committed modules match the .proto files; proto/test_pool.py: they
load beside tritonclient's.)"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from server.grpc.proto import grpc_service_pb2, model_config_pb2


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
