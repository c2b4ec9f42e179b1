"""Which concurrency steps to run, and which step wins under a latency SLO."""

from __future__ import annotations

from collections.abc import Sequence

from loadtests.results import StepResult, Verdict

MAX_STEPS = 100


def parse_ramp(text: str) -> list[int]:
    """User counts of a `START:STOP:STEP` ramp, STOP included when the steps land on it.

    STEP adds (`4:32:4` -> 4, 8, ..., 32) or, written `xF`, multiplies (`1:64:x2` -> 1, 2, ..., 64).
    """
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"ramp '{text}' is not START:STOP:STEP (e.g. 4:32:4 or 1:64:x2)")
    try:
        start, stop = int(parts[0]), int(parts[1])
        step_text = parts[2].strip().lower()
        factor = float(step_text[1:]) if step_text.startswith("x") else None
        increment = int(step_text) if factor is None else 0
    except ValueError:
        raise ValueError(
            f"ramp '{text}': START and STOP must be whole numbers and STEP a whole number "
            "or x<factor>"
        ) from None
    if start < 1 or stop < start:
        raise ValueError(f"ramp '{text}': need 1 <= START <= STOP, got START={start} STOP={stop}")
    if factor is not None and factor <= 1:
        raise ValueError(f"ramp '{text}': a multiplying STEP must be > 1, got x{factor:g}")
    if factor is None and increment < 1:
        raise ValueError(f"ramp '{text}': STEP must be >= 1, got {increment}")
    users = [start]
    while True:
        following = int(users[-1] * factor) if factor is not None else users[-1] + increment
        following = max(following, users[-1] + 1)
        if following > stop:
            break
        users.append(following)
        if len(users) > MAX_STEPS:
            raise ValueError(f"ramp '{text}' has more than {MAX_STEPS} steps; use a larger STEP")
    return users


def meets_slo(step: StepResult, slo_p99_ms: float, max_error_fraction: float) -> bool:
    """p99 within the SLO and few enough failed requests (a step that sheds load with 429s or
    503s is fast, not good) and at least one successful response."""
    p99 = step.total.latency.p99_ms
    return (
        p99 is not None
        and p99 <= slo_p99_ms
        and step.error_fraction <= max_error_fraction
        and step.total.ok_rps > 0
    )


def best_step(
    steps: Sequence[StepResult], slo_p99_ms: float | None, max_error_fraction: float
) -> tuple[StepResult | None, Verdict]:
    """The step with the highest goodput (within the SLO when there is one) and the verdict.

    The verdict fails only when no step meets the SLO; the ramp stops at the first step that
    misses it, so in practice that means the first (lowest) step missed it.
    """
    if not steps:
        return None, "fail" if slo_p99_ms is not None else "no_slo"
    if slo_p99_ms is None:
        return max(steps, key=lambda s: s.total.ok_rps), "no_slo"
    within = [s for s in steps if meets_slo(s, slo_p99_ms, max_error_fraction)]
    if not within:
        return None, "fail"
    return max(within, key=lambda s: s.total.ok_rps), "pass"
