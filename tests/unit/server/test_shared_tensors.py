"""Tensors in client shared memory for the data plane (server/shared_tensors.py): sizes checked
before any read, inputs decoded from their region, outputs written and answered without data."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from engine.errors import InvalidInput, PayloadTooLarge
from engine.regions import SystemRegions
from engine.settings import SharedMemorySettings
from engine.types import InferRequest, InferResponse, SharedTensor
from server.shared_tensors import read_inputs, write_outputs


@pytest.fixture
def regions(tmp_path: Path) -> SystemRegions:
    return SystemRegions(SharedMemorySettings(enabled=True), tmp_path)


def request(shared: dict[str, SharedTensor], datatypes: dict[str, str]) -> InferRequest:
    return InferRequest("m", {}, datatypes, shared_inputs=shared)


async def test_sizes_are_checked_before_any_region_is_looked_up(regions: SystemRegions) -> None:
    # No region "r" exists: each refusal comes before the registry is asked for it.
    wrong = request({"x": SharedTensor("r", 0, 12, (2, 2))}, {"x": "FP32"})
    with pytest.raises(InvalidInput, match=r"shape \[2, 2\] of FP32 \(16 bytes\) but .* 12"):
        await read_inputs(regions, "a", wrong, 1024)
    big = request(
        {"x": SharedTensor("r", 0, 800, (200,)), "z": SharedTensor("r", 0, 800, (200,))},
        {"x": "FP32", "z": "FP32"},
    )
    with pytest.raises(PayloadTooLarge):
        await read_inputs(regions, "a", big, 1024)


async def test_fixed_and_bytes_inputs_are_read_from_their_region(
    regions: SystemRegions, tmp_path: Path
) -> None:
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    texts = b"".join(struct.pack("<I", len(t)) + t for t in (b"ab", b"", b"xyz"))
    (tmp_path / "in").write_bytes(x.tobytes() + texts)
    await regions.register("a", "k", "in", "/in", 0, x.nbytes + len(texts))
    shared = {
        "x": SharedTensor("in", 0, x.nbytes, (2, 3)),
        "t": SharedTensor("in", x.nbytes, len(texts), (3,)),
    }
    decoded = request(shared, {"x": "INT32", "t": "BYTES"})
    await read_inputs(regions, "a", decoded, 1024)
    np.testing.assert_array_equal(decoded.inputs["x"], x)
    assert decoded.inputs["t"].tolist() == [b"ab", b"", b"xyz"]
    short = request({"t": SharedTensor("in", x.nbytes, len(texts), (4,))}, {"t": "BYTES"})
    with pytest.raises(InvalidInput, match="input 't'"):
        await read_inputs(regions, "a", short, 1024)


async def test_outputs_are_written_and_the_answer_is_a_copy(
    regions: SystemRegions, tmp_path: Path
) -> None:
    (tmp_path / "out").write_bytes(bytes(16))
    await regions.register("a", "k", "out", "/out", 0, 16)
    y = np.array([1.5, -2.0], np.float32)
    shared = {"y": SharedTensor("out", 4, 8), "absent": SharedTensor("out", 0, 4)}
    asked = InferRequest("m", {}, {}, shared_outputs=shared)
    answer = InferResponse("m", "1", {"y": y, "z": y}, {"y": "FP32", "z": "FP32"})
    written = await write_outputs(regions, "a", asked, answer)
    assert written.shared_outputs == {"y": SharedTensor("out", 4, 8)}
    assert answer.shared_outputs is None  # a cached or coalesced answer is never changed
    assert written.outputs is answer.outputs
    assert (tmp_path / "out").read_bytes() == bytes(4) + y.tobytes() + bytes(4)
    small = InferRequest("m", {}, {}, shared_outputs={"y": SharedTensor("out", 0, 4)})
    with pytest.raises(
        InvalidInput, match="output 'y' takes 8 bytes; shared_memory_byte_size is 4"
    ):
        await write_outputs(regions, "a", small, answer)
