"""What the engine settles of a request before admission charges for it: when its clock
started, its rows, its priority level; and `Accepted`, the request with them, as admission and
the stages after it take it (engine/engine.py)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from engine.errors import Forbidden, InvalidInput
from engine.model import LoadedModel
from engine.types import InferRequest

MAX_FRONT_END_S = 3600.0
"""A request's `arrived` older than this (or later than the engine took it) is not believed."""


class Clock(NamedTuple):
    """A request's two times, on time.monotonic()."""

    arrived: float
    """When its clock started: its deadline and its latency target count from there."""
    received: float
    """When the engine received it: its time in the model's statistics counts from there
    (Triton's `success`: decoding and encoding are the front-end's)."""


def request_clock(given: float | None) -> Clock:
    """The request's clock: it started when the data plane took it (`arrived`, `given`), or
    when the engine received it for a request without one, or with one the front-end cannot
    have taken (later than that, or more than MAX_FRONT_END_S before: it may come from
    another process)."""
    received = time.monotonic()
    if given is not None and received - MAX_FRONT_END_S <= given <= received:
        return Clock(given, received)
    return Clock(received, received)


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
    clock: Clock
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
