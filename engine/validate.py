"""Checks a decoded request against the model's metadata before it is queued."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from engine.datatypes import UINT64_MAX, past_64_bits, shown
from engine.errors import InvalidInput
from engine.model_config import ModelConfig, parse_model_config
from engine.settings import SettingsError
from engine.types import InferRequest, TensorSpec

InputCheck = Callable[[Mapping[str, Sequence[int]], Mapping[str, str]], object]
"""Checks declared input shapes and datatypes (by name) against a model: `check_inputs` bound
to one model's inputs (`Engine.input_check`)."""


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def check_request(
    request: InferRequest,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    max_batch_size: int,
    label: str,
) -> int:
    """Raise InvalidInput naming the first problem; return the request's rows (1 if unbatched)."""
    shapes = {name: array.shape for name, array in request.inputs.items()}
    rows = check_inputs(shapes, request.datatypes, inputs, max_batch_size, label)
    if request.outputs is not None:
        check_outputs(request.outputs, outputs, label)
    return rows


def check_outputs(names: Sequence[str], outputs: Sequence[TensorSpec], label: str) -> None:
    """The outputs a request asks for by name: InvalidInput for one the model lacks or one
    asked twice."""
    known = [spec.name for spec in outputs]
    for name in names:
        if name not in known:
            raise InvalidInput(
                f"unknown output '{name}' requested from {label}; it has: {', '.join(known)}"
            )
    if len(set(names)) != len(names):
        raise InvalidInput(f"an output is requested twice: {', '.join(names)}")


def unchecked(shapes: Mapping[str, Sequence[int]], datatypes: Mapping[str, str]) -> None:
    """The front-end check of a model whose inputs are not known yet (on_demand, never loaded):
    none; the engine checks the decoded request once the model is loaded."""


def check_inputs(
    shapes: Mapping[str, Sequence[int]],
    datatypes: Mapping[str, str],
    inputs: Sequence[TensorSpec],
    max_batch_size: int,
    label: str,
) -> int:
    """The inputs' names, datatypes, shapes and batch size against the model's: InvalidInput
    naming the first problem, else the rows (1 if unbatched). Front-ends call it with the shapes
    a request declares, before decoding any tensor data; the engine with the decoded arrays'."""
    expected = {spec.name: spec for spec in inputs}
    for name in shapes:
        if name not in expected:
            raise InvalidInput(
                f"unexpected input '{name}' for {label}; it takes: {', '.join(expected)}"
            )
    rows: int | None = None
    for spec in inputs:
        if spec.name not in shapes:
            raise InvalidInput(
                f"missing input '{spec.name}' for {label}; it takes: {', '.join(expected)}"
            )
        datatype = datatypes.get(spec.name, spec.datatype)
        if datatype != spec.datatype:
            raise InvalidInput(
                f"input '{spec.name}' has datatype {datatype}; {label} expects {spec.datatype}"
            )
        shape = shapes[spec.name]
        if len(shape) != len(spec.shape) or any(
            want not in (-1, got) for got, want in zip(shape, spec.shape, strict=False)
        ):
            raise InvalidInput(
                f"input '{spec.name}' has shape {_fmt(shape)}; {label} expects {_fmt(spec.shape)}"
            )
        if max_batch_size > 0:
            if rows is not None and shape[0] != rows:
                raise InvalidInput(
                    f"input '{spec.name}' has batch size {shape[0]} but other inputs have {rows}; "
                    "every input must have the same first dimension"
                )
            rows = shape[0]
    if max_batch_size > 0 and rows is not None:
        if rows < 1:
            raise InvalidInput(f"batch size is 0; {label} needs at least 1 row")
        if rows > max_batch_size:
            raise InvalidInput(
                f"batch size {rows} exceeds the maximum of {max_batch_size} for {label}"
            )
    return rows if rows is not None else 1


def scheduling(parameters: Mapping[str, Any]) -> tuple[int | None, float | None]:
    """The request's `priority` level and queue timeout in seconds, from its parameters, as
    Triton reads them: priority 1 is the highest level and 0 means the model's default (None
    here); `timeout` is in microseconds and 0 means none. Shared by every front-end."""
    priority = _non_negative(parameters, "priority") or None
    return priority, _seconds(_non_negative(parameters, "timeout"))


MAX_PARAMETER_DEPTH = 32
"""How deeply a request parameter's value may nest lists and objects (JSON allows any depth)."""


_NESTING = (dict, list)


def check_parameters(parameters: Mapping[str, Any], where: str) -> None:
    """InvalidInput when a parameter's value nests lists and objects past MAX_PARAMETER_DEPTH.
    Iterative, so no depth a client sends can exhaust the stack while it is measured; a level
    at a time, in C passes over its values (their types, then the lists and objects among
    them), not a Python step and a stack entry per value (256 kB of `[[1],[1],...]` took 63 ms
    on the event loop)."""
    for key, value in parameters.items():
        level = [value] if isinstance(value, _NESTING) else []
        depth = 1
        while level:
            if depth > MAX_PARAMETER_DEPTH:
                raise InvalidInput(
                    f"{where}: parameter '{key}' is nested deeper than {MAX_PARAMETER_DEPTH} levels"
                )
            values = list(
                itertools.chain.from_iterable(
                    item.values() if isinstance(item, dict) else item for item in level
                )
            )
            nested = any(issubclass(kind, _NESTING) for kind in set(map(type, values)))
            level = [item for item in values if isinstance(item, _NESTING)] if nested else []
            depth += 1


def _non_negative(parameters: Mapping[str, Any], key: str) -> int | None:
    """An integer parameter from 0 to UINT64_MAX (Triton's uint64), or None when absent."""
    value = parameters.get(key)
    if value is None:
        return None
    if past_64_bits(value) or (type(value) is int and value > UINT64_MAX):
        raise InvalidInput(
            f"parameter '{key}' is out of range (0 to {UINT64_MAX}), got {shown(value)}"
        )
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"parameter '{key}' must be a non-negative integer, got {value!r:.60}")
    return value


def _seconds(micros: int | None) -> float | None:
    return micros / 1e6 if micros else None


LOAD_CONFIG = "config"
"""Triton's load parameter holding a model config as a JSON string."""


def check_load_parameters(parameters: Mapping[str, Any] | Collection[str]) -> ModelConfig | None:
    """The model config a load request carries in Triton's `config` parameter (a JSON string
    holding what config.yaml would, validated the same way), or None without one. Any other
    parameter (Triton's `file:` overrides) is InvalidInput: model files come only from the
    repository folder. Names without values (an older caller) cannot carry a config."""
    values: Mapping[str, Any] = (
        parameters if isinstance(parameters, Mapping) else dict.fromkeys(parameters)
    )
    unknown = sorted(set(values) - {LOAD_CONFIG})
    if unknown:
        raise InvalidInput(
            f"unknown load parameters {', '.join(unknown)}; allowed: {LOAD_CONFIG} (a JSON model "
            "config). Model files come only from the repository folder"
        )
    if LOAD_CONFIG not in values:
        return None
    text = values[LOAD_CONFIG]
    if not isinstance(text, str):
        raise InvalidInput(
            f"load parameter '{LOAD_CONFIG}' must be a JSON string holding the model config, "
            f"got {type(text).__name__}"
        )
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidInput(f"load parameter '{LOAD_CONFIG}' is not valid JSON: {exc}") from None
    try:
        return parse_model_config(data, source=f"load parameter '{LOAD_CONFIG}'")
    except SettingsError as exc:
        raise InvalidInput(str(exc)) from exc


def check_unload_parameters(parameters: Collection[str]) -> None:
    # `unload_dependents` (always sent by tritonclient) has no effect: sluice has no ensembles.
    unknown = sorted(set(parameters) - {"unload_dependents"})
    if unknown:
        raise InvalidInput(
            f"unknown unload parameters {', '.join(unknown)}; allowed: unload_dependents"
        )
