"""The I/O tensor specs the TensorRT backend reads from an engine (fake TensorRT 10, tests/fakes),
and the tensors it refuses at load."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from engine.errors import BackendError
from tests.unit.engine.backends.tensorrt_plans import PROFILE_0, TENSORS, open_backend, write_plan


def test_metadata_comes_from_the_engine(tmp_path: Path, trt: ModuleType) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    try:
        assert [(s.name, s.datatype, s.shape) for s in backend.inputs] == [
            ("x", "FP32", (-1, 4)), ("ids", "INT64", (-1, -1))
        ]  # fmt: skip
        assert [s.name for s in backend.outputs] == ["y", "ids_out"]
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": "BF16"}, "tensor 'x' has type DataType.BF16, which sluice cannot serve"),
        ({"shape_tensor": True}, "input 'x' is a shape tensor"),
    ],
)
def test_tensors_the_backend_cannot_feed_are_refused_at_load(
    tmp_path: Path, trt: ModuleType, change: dict[str, object], message: str
) -> None:
    path = write_plan(tmp_path, trt)
    path.write_bytes(trt.plan([{**TENSORS[0], **change}, *TENSORS[1:]], [PROFILE_0]))
    with pytest.raises(BackendError, match=re.escape(message)):
        open_backend(path)
