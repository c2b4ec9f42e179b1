"""server.grpc.proto.pool: sluice's protocol modules live in their own descriptor pool, so they
load in one process with tritonclient's (which define the same `inference.*` names)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.grpc.proto import grpc_service_pb2, model_config_pb2
from server.grpc.proto.pool import POOL


def test_the_modules_are_in_sluices_pool_not_protobufs_default() -> None:
    from google.protobuf import descriptor_pool

    for module in (grpc_service_pb2, model_config_pb2):
        assert module.DESCRIPTOR.pool is POOL
    assert POOL is not descriptor_pool.Default()
    assert POOL.FindMessageTypeByName("inference.ModelInferRequest").name == "ModelInferRequest"


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
