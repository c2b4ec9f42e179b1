"""What the engine settles of a request before admission charges for it: when its clock
started, its rows, its priority level; and `Accepted`, the request with them, as admission and
the stages after it take it (engine/engine.py)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from engine.errors import Forbidden, InvalidInput
from engine.model import LoadedModel
from engine.types import InferRequest

MAX_FRONT_END_S = 3600.0
"""A request's `arrived` older than this (or later than the engine took it) is not believed."""


def clock_start(given: float | None) -> float:
    """When the request's clock started: when the data plane took it (`arrived`), or now for
    a request without one, or with one that the front-end cannot have taken (later than now,
    or more than MAX_FRONT_END_S ago: it may come from another process). Its deadline, its
    latency target and its time in the model's statistics count from there."""
    now = time.monotonic()
    return given if given is not None and now - MAX_FRONT_END_S <= given <= now else now


def first_axis(request: InferRequest) -> int:
    """The rows of a request whose model was never loaded (on_demand), for its admission: its
    first input's first axis."""
    first: np.ndarray | None = next(iter(request.inputs.values()), None)
    return len(first) if first is not None and first.ndim else 1


@dataclass(slots=True)
class Accepted:
    """A request past every check that can refuse it, as admission and the stages after it
    take it."""

    model: LoadedModel
    request: InferRequest
    tenant: str
    rows: int
    priority: int
    arrived: float
    """When its clock started (`clock_start`)."""
    use_cache: bool
    load: Callable[[], Awaitable[LoadedModel]] | None = None
    """On_demand: gives the version to run, `model` being an evicted version's last load."""


def priority_level(
    model: LoadedModel, asked: int | None, tenant: str, tenant_priority: int, keyless: bool
) -> int:
    """The request's batching level, numbered as in Triton (1 is the highest): as asked, or
    else the tenant's own level, or else the model's default_priority_level; 0 asks for the
    default. A tenant level past the model's lowest is its lowest. With API keys configured,
    no tenant may ask for a higher level (a smaller number) than its own (`keyless`: none
    configured)."""
    batching = model.config.dynamic_batching
    lowest = batching.priority_levels
    own = min(tenant_priority, lowest) if tenant_priority else batching.default_level
    if not asked:
        return own
    if asked > lowest:
        raise InvalidInput(
            f"priority {asked} is out of range for {model.label}: its priority levels are "
            f"1 (highest) to {lowest} (lowest), and 0 or none means its default level "
            f"{batching.default_level}"
        )
    if not keyless and asked < own:
        raise Forbidden(
            f"tenant '{tenant}' may use priority levels {own} to {lowest} of {model.label} "
            f"(1 is the highest); asked for {asked}"
        )
    return asked
