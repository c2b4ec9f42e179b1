"""Request, response and metadata types shared by the engine and every front-end."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output. `shape` includes the batch dimension; -1 marks a dynamic axis."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    dim_names: tuple[str | None, ...] = field(default=(), compare=False)
    """The model's symbolic name of each axis (None where it has none); empty when unknown."""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    """What the v2 model metadata endpoint reports."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class SharedTensor:
    """Where a tensor lies in a client's registered shared-memory region (engine/regions.py):
    Triton's `shared_memory_region`, `shared_memory_offset` (relative to the region's own
    offset) and `shared_memory_byte_size` parameters; `shape` is an input's declared shape."""

    region: str
    offset: int
    byte_size: int
    shape: tuple[int, ...] = ()


@dataclass(slots=True)
class InferRequest:
    """A decoded inference request.

    `inputs` maps each input name to its array; BYTES tensors are numpy object arrays of `bytes`.
    `datatypes` holds the datatype the client declared for each input (checked against the model).
    `outputs` is the requested output names, or None for all of them.
    `shared_inputs` are inputs the client left in shared-memory regions: the data plane reads
    them into `inputs` before the engine sees the request. `shared_outputs` are requested
    outputs the data plane writes into regions once answered.
    """

    model_name: str
    inputs: dict[str, np.ndarray]
    datatypes: dict[str, str]
    model_version: str | None = None
    id: str | None = None
    outputs: list[str] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    timeout_s: float | None = None
    tenant: str | None = None
    arrived: float | None = None
    """time.monotonic() when the front-end took the request: its timeout and its model's
    latency target count from there (None: from when the engine took it)."""
    shared_inputs: dict[str, SharedTensor] | None = None
    shared_outputs: dict[str, SharedTensor] | None = None
    checked: Checked | None = None
    """The input check its front-end ran on the declared shapes and datatypes (the data plane
    sets it): the engine neither resolves the model nor checks the inputs again when that check
    is of the model version that serves the request."""


class Checked:
    """An input check as the data plane hands it to one request's decoder (in place of the
    check itself): what `check` returned, kept with the request it checked."""

    __slots__ = ("check", "rows")

    def __init__(self, check: Callable[..., object]) -> None:
        self.check = check
        self.rows: object = None
        """What `check` returned (a model's check: the request's rows); None until it ran."""

    def __call__(self, shapes: Mapping[str, Sequence[int]], datatypes: Mapping[str, str]) -> None:
        self.rows = self.check(shapes, datatypes)


@dataclass(slots=True)
class InferResponse:
    """The engine's answer: one array per output, in the model's output order."""

    model_name: str
    model_version: str
    outputs: dict[str, np.ndarray]
    datatypes: dict[str, str]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    shared_outputs: dict[str, SharedTensor] | None = None
    """Outputs written into the client's shared-memory regions: answered without their data."""
