"""Token-bucket arithmetic, free of clocks and storage so both backends share it.

A bucket holds up to `burst` tokens and gains `rate_per_s` tokens per second. A request of
`units` passes when the bucket holds at least `units` tokens, and then takes them. The Redis
backend's Lua script (`admit.lua`) repeats `refill` and the pass test; everything a client is
told (Retry-After, remaining, reset) is derived here from the level the backend reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BucketState:
    """A stored bucket: its tokens at `updated_s` (seconds on the backend's clock)."""

    tokens: float
    updated_s: float


def effective_burst(rate_per_s: float, burst: float | None) -> float:
    """The bucket size: `burst`, or one second of `rate_per_s` but at least one unit."""
    return burst if burst is not None else max(1.0, rate_per_s)


def refill(state: BucketState | None, now_s: float, rate_per_s: float, burst: float) -> float:
    """Tokens in the bucket at `now_s`. A missing bucket is full; a clock that went backwards
    adds nothing (never a negative refill)."""
    if state is None:
        return burst
    elapsed_s = max(0.0, now_s - state.updated_s)
    return min(burst, state.tokens + elapsed_s * rate_per_s)


def passes(tokens: float, units: float) -> bool:
    """Whether a request of `units` may take tokens from a bucket holding `tokens`."""
    return units <= tokens


def retry_after_s(tokens: float, units: float, rate_per_s: float) -> float:
    """Seconds until the bucket holds `units` tokens (0 when it already does)."""
    return max(0.0, (units - tokens) / rate_per_s)


def reset_after_s(tokens: float, burst: float, rate_per_s: float) -> float:
    """Seconds until the bucket is full again."""
    return max(0.0, (burst - tokens) / rate_per_s)


def whole_seconds(seconds: float) -> int:
    """Seconds rounded up to whole ones, as headers carry them (0 stays 0). Rounds to the
    microsecond first (the backends' clock resolution) so float noise such as 2.0000000000000004
    does not add a second."""
    return max(0, math.ceil(round(seconds, 6)))
