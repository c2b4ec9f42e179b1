"""Input specs (`--input NAME:DTYPE:SHAPE[:LOW..HIGH]`), padding requests (`--pad NAME:AXIS:VALUE`)
and the example tensors built from them.

A SHAPE lists every axis, the batch axis included: `-1,3,224,224` or `batch,sequence=128`. An
axis is a fixed size (`3`), a dynamic axis (`-1`), or a named dynamic axis (`sequence`); axes that
share a name share a size. `name=N` sets the size used for examples and validation (default 8; the
batch axis uses the batch being run). LOW..HIGH bounds random values (integers: LOW <= v < HIGH),
e.g. token ids below the vocabulary size."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from converters.errors import ConversionError
from engine.datatypes import NUMPY_DTYPES, from_numpy

DEFAULT_AXIS_SIZE = 8
"""Example size of a dynamic non-batch axis when the spec does not give one."""
EXPORT_BATCH = 2
"""Batch of the example passed to torch.export: 0 and 1 would be specialized as constants."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")
_AXIS = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(=(?P<size>[0-9]+))?$")
_NUMPY_NAMES = {"float": "float32", "half": "float16", "double": "float64", "int": "int64"}


@dataclass(frozen=True)
class Axis:
    """One axis: fixed (`name` is None) or dynamic with a name and an example size."""

    size: int
    name: str | None = None

    @property
    def dynamic(self) -> bool:
        return self.name is not None


@dataclass(frozen=True)
class InputSpec:
    """A model input: name, numpy dtype, axes (batch axis first) and a value range."""

    name: str
    dtype: np.dtype[np.generic]
    axes: tuple[Axis, ...]
    low: float | None = None
    high: float | None = None

    @property
    def batched(self) -> bool:
        """True when the first axis is dynamic, i.e. rows of a batch."""
        return bool(self.axes) and self.axes[0].dynamic

    @property
    def datatype(self) -> str:
        """The Open Inference Protocol datatype name (FP32, INT64, ...)."""
        return from_numpy(self.dtype)

    def shape(self, batch: int | None = None) -> tuple[int, ...]:
        """Concrete shape of an example; `batch` replaces the first axis of a batched input."""
        sizes = [axis.size for axis in self.axes]
        if batch is not None and self.batched:
            sizes[0] = batch
        return tuple(sizes)

    def dims(self) -> list[int | str]:
        """The shape as shown in reports: fixed sizes and dynamic axis names."""
        return [axis.name if axis.name is not None else axis.size for axis in self.axes]


@dataclass(frozen=True)
class PadRequest:
    """`--pad NAME:AXIS:VALUE`: the user vouches that padding NAME along AXIS with VALUE is
    harmless, so the server may batch requests of different lengths."""

    name: str
    axis: int
    value: float


def parse_dtype(text: str) -> np.dtype[np.generic]:
    """A numpy dtype from a v2 name (FP32, INT64) or a numpy name (float32, int64)."""
    upper = text.strip().upper()
    if upper in NUMPY_DTYPES and upper != "BYTES":
        return NUMPY_DTYPES[upper]
    name = _NUMPY_NAMES.get(text.strip().lower(), text.strip().lower())
    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = np.dtype(np.object_)
    if dtype.kind not in "biuf":
        allowed = ", ".join(key for key in NUMPY_DTYPES if key != "BYTES")
        raise ConversionError(f"unknown or unsupported dtype '{text}'; allowed: {allowed}")
    return dtype


def parse_input(text: str) -> InputSpec:
    """Parse `NAME:DTYPE:SHAPE[:LOW..HIGH]`, e.g. `input_ids:INT64:batch,sequence=16:0..1000`."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ConversionError(
            f"--input '{text}' is not NAME:DTYPE:SHAPE[:LOW..HIGH] (e.g. x:FP32:-1,3,32,32)"
        )
    name, dtype_text, shape_text = parts[:3]
    if not _NAME.match(name):
        raise ConversionError(f"--input '{text}': '{name}' is not a valid tensor name")
    axes = _parse_axes(name, shape_text.strip().strip("[]()"), text)
    low, high = _parse_range(parts[3], text) if len(parts) == 4 else (None, None)
    return InputSpec(name, parse_dtype(dtype_text), axes, low, high)


def _parse_axes(name: str, shape_text: str, text: str) -> tuple[Axis, ...]:
    axes: list[Axis] = []
    for index, item in enumerate(part.strip() for part in shape_text.split(",") if part.strip()):
        if item == "-1":
            axes.append(Axis(DEFAULT_AXIS_SIZE, "batch" if index == 0 else f"{name}_{index}"))
        elif item.isdigit() and int(item) > 0:
            axes.append(Axis(int(item)))
        elif match := _AXIS.match(item):
            size = int(match["size"]) if match["size"] else DEFAULT_AXIS_SIZE
            if size <= 0:
                raise ConversionError(f"--input '{text}': axis '{item}' needs a size above 0")
            axes.append(Axis(size, match["name"]))
        else:
            raise ConversionError(
                f"--input '{text}': axis '{item}' is not a size above 0, -1, NAME or NAME=SIZE"
            )
    if not axes:
        raise ConversionError(f"--input '{text}': the shape has no axes")
    return tuple(axes)


def _parse_range(text: str, whole: str) -> tuple[float, float]:
    low_text, sep, high_text = text.partition("..")
    try:
        low, high = float(low_text), float(high_text)
    except ValueError:
        low, high = 0.0, -1.0
    if not sep or low >= high:
        raise ConversionError(
            f"--input '{whole}': value range '{text}' is not LOW..HIGH with LOW<HIGH"
        )
    return low, high


def unify_axes(specs: list[InputSpec]) -> list[InputSpec]:
    """Give axes that share a name one example size (the one a spec set, if any)."""
    sizes: dict[str, int] = {}
    for spec in specs:
        for axis in spec.axes[1:] if spec.batched else spec.axes:
            if axis.name is None or axis.size == DEFAULT_AXIS_SIZE:
                continue
            if sizes.setdefault(axis.name, axis.size) != axis.size:
                raise ConversionError(
                    f"axis '{axis.name}' is given sizes {sizes[axis.name]} and {axis.size}; "
                    "axes that share a name must share a size"
                )
    return [
        replace(
            spec,
            axes=tuple(
                replace(axis, size=sizes.get(axis.name, axis.size)) if axis.name else axis
                for axis in spec.axes
            ),
        )
        for spec in specs
    ]


def parse_pad(text: str) -> PadRequest:
    """Parse `NAME:AXIS:VALUE`, e.g. `input_ids:1:0` (pad token 0 along the sequence axis)."""
    name, _, rest = text.rpartition(":")
    name, _, axis_text = name.rpartition(":")
    try:
        axis, value = int(axis_text), float(rest)
    except ValueError:
        axis, value = -1, 0.0
    if not name or axis <= 0:
        raise ConversionError(
            f"--pad '{text}' is not NAME:AXIS:VALUE with AXIS > 0 "
            "(the batch axis 0 is never padded)"
        )
    return PadRequest(name, axis, value)


def check_pads(pads: list[PadRequest], specs: list[InputSpec]) -> None:
    """Every pad names an input and a dynamic non-batch axis of it."""
    by_name = {spec.name: spec for spec in specs}
    for pad in pads:
        spec = by_name.get(pad.name)
        if spec is None:
            raise ConversionError(
                f"--pad names input '{pad.name}'; the model's inputs are {', '.join(by_name)}"
            )
        if pad.axis >= len(spec.axes) or not spec.axes[pad.axis].dynamic:
            raise ConversionError(
                f"--pad {pad.name}:{pad.axis}: input '{pad.name}' has shape {spec.dims()}; "
                "only a dynamic axis other than the batch axis can be padded"
            )


def random_feeds(
    specs: list[InputSpec], batch: int | None, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Random inputs matching the specs (normal floats, small integers unless a range is set)."""
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = spec.shape(batch)
        if spec.dtype.kind == "b":
            feeds[spec.name] = rng.random(shape) < 0.5
        elif spec.dtype.kind in "iu":
            low = 0 if spec.low is None else int(spec.low)
            high = 10 if spec.high is None else int(spec.high)
            feeds[spec.name] = rng.integers(low, high, shape).astype(spec.dtype)
        elif spec.low is not None and spec.high is not None:
            feeds[spec.name] = rng.uniform(spec.low, spec.high, shape).astype(spec.dtype)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    return feeds
