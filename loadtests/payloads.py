"""Random inference inputs built from a model's v2 metadata, encoded for each protocol.

A `PayloadFactory` deals a fresh random input on most calls and, with probability
`cache_hit_fraction`, one of a small pool of repeated inputs. The pool is drawn from a fixed seed,
so every user and every worker (on any machine) repeats the same inputs and the server's result
cache sees hits across all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

# engine.datatypes imports only numpy and engine.errors (a test keeps it so): light enough for
# locust processes, which must not import the server.
from engine.datatypes import NUMPY_DTYPES

REPEATED_POOL_SIZE = 8
"""Distinct repeated inputs: a few, so the cache holds them all, more than one, so the server
cannot get away with a single memoised answer."""


@dataclass(frozen=True, slots=True)
class TensorShape:
    """One input of the model with its dynamic dimensions resolved."""

    name: str
    datatype: str
    shape: tuple[int, ...]


def resolve_inputs(
    metadata: Mapping[str, Any], batch_size: int = 1, dynamic_size: int = 1
) -> list[TensorShape]:
    """The concrete input shapes: a -1 first dimension becomes `batch_size`, other -1s
    `dynamic_size`."""
    inputs = metadata.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ValueError(f"model metadata has no inputs: {dict(metadata)!r}")
    resolved = []
    for spec in inputs:
        datatype = str(spec["datatype"])
        if datatype not in NUMPY_DTYPES:
            allowed = ", ".join(NUMPY_DTYPES)
            raise ValueError(f"input '{spec['name']}' has datatype {datatype}; allowed: {allowed}")
        dims = [int(d) for d in spec["shape"]]
        shape = tuple(
            (batch_size if i == 0 else dynamic_size) if d < 0 else d for i, d in enumerate(dims)
        )
        resolved.append(TensorShape(str(spec["name"]), datatype, shape))
    return resolved


def output_names(metadata: Mapping[str, Any]) -> list[str]:
    """The model's output names, in metadata order."""
    return [str(spec["name"]) for spec in metadata.get("outputs", [])]


def random_tensor(spec: TensorShape, rng: np.random.Generator) -> np.ndarray:
    """Random data of the input's datatype: floats in [0, 1), small integers, random words."""
    if spec.datatype == "BYTES":
        flat = [f"w{value}".encode() for value in rng.integers(0, 1000, int(np.prod(spec.shape)))]
        array = np.empty(len(flat), dtype=np.object_)
        array[:] = flat
        return array.reshape(spec.shape)
    dtype = NUMPY_DTYPES[spec.datatype]
    if spec.datatype == "BOOL":
        return rng.integers(0, 2, spec.shape).astype(np.bool_)
    if dtype.kind == "f":
        return rng.random(spec.shape, dtype=np.float32).astype(dtype)
    # Small non-negative integers stay valid for id-like inputs (token ids, categories).
    return rng.integers(0, 10, spec.shape).astype(dtype)


def _bytes_element(value: bytes) -> bytes:
    return len(value).to_bytes(4, "little") + value


def raw_bytes(array: np.ndarray) -> bytes:
    """The binary tensor extension's encoding: little-endian row-major data; BYTES elements are
    each a 4-byte little-endian length followed by the bytes."""
    if array.dtype == np.object_:
        return b"".join(_bytes_element(bytes(v)) for v in array.ravel())
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def json_body(
    inputs: Sequence[TensorShape], arrays: Sequence[np.ndarray], outputs: Sequence[str]
) -> bytes:
    """A v2 JSON infer request (data flattened row-major)."""
    tensors = []
    for spec, array in zip(inputs, arrays, strict=True):
        data: Any = array.ravel()
        if array.dtype == np.object_:
            data = [bytes(v).decode("utf-8", "replace") for v in data]
        tensors.append(
            {"name": spec.name, "shape": list(spec.shape), "datatype": spec.datatype, "data": data}
        )
    body = {"inputs": tensors, "outputs": [{"name": name} for name in outputs]}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def binary_body(
    inputs: Sequence[TensorShape], arrays: Sequence[np.ndarray], outputs: Sequence[str]
) -> tuple[bytes, int]:
    """A v2 binary-extension infer request asking for binary outputs: (body, JSON header length)."""
    blobs = [raw_bytes(array) for array in arrays]
    header = {
        "inputs": [
            {
                "name": spec.name,
                "shape": list(spec.shape),
                "datatype": spec.datatype,
                "parameters": {"binary_data_size": len(blob)},
            }
            for spec, blob in zip(inputs, blobs, strict=True)
        ],
        "outputs": [{"name": name, "parameters": {"binary_data_output": True}} for name in outputs],
    }
    head = orjson.dumps(header)
    return head + b"".join(blobs), len(head)


class PayloadFactory:
    """Deals input arrays: repeated ones with probability `cache_hit_fraction`, else fresh ones."""

    def __init__(
        self,
        inputs: Sequence[TensorShape],
        cache_hit_fraction: float,
        seed: int,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.inputs = list(inputs)
        self.cache_hit_fraction = cache_hit_fraction
        self._rng = rng if rng is not None else np.random.default_rng()
        pool_rng = np.random.default_rng(seed)
        self.pool = [
            [random_tensor(spec, pool_rng) for spec in self.inputs]
            for _ in range(REPEATED_POOL_SIZE)
        ]

    def next_arrays(self) -> tuple[list[np.ndarray], bool]:
        """One request's arrays, in input order, and whether they are a repeated input."""
        if self.cache_hit_fraction > 0 and self._rng.random() < self.cache_hit_fraction:
            return self.pool[int(self._rng.integers(len(self.pool)))], True
        return [random_tensor(spec, self._rng) for spec in self.inputs], False
