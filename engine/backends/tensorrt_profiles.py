"""Optimization profiles of a TensorRT engine as the backend uses them: each input's (min, opt,
max) shapes per profile, and the profile a batch runs on. Pure Python (no TensorRT import), so
the choice and its errors are tested on any machine."""

from __future__ import annotations

from collections.abc import Mapping

from engine.errors import InvalidInput

Shape = tuple[int, ...]
Limits = tuple[Shape, Shape, Shape]
"""One input's (min, opt, max) shapes under one profile."""


class Profiles:
    """The profiles one instance may use, each as {input name: Limits}."""

    def __init__(self, limits: Mapping[int, Mapping[str, Limits]]) -> None:
        self.limits = {profile: dict(inputs) for profile, inputs in limits.items()}

    def largest(self, profile: int, name: str) -> Shape:
        """The largest shape of an input that a profile allows."""
        return self.limits[profile][name][2]

    def choose(self, shapes: Mapping[str, Shape]) -> int:
        """The profile whose ranges hold every input's shape, nearest its opt shapes (as Triton
        picks; ties go to the lower index); a shape no profile holds is InvalidInput naming
        what each profile allows."""
        fitting = [p for p, inputs in self.limits.items() if _fit_all(shapes, inputs)]
        if fitting:
            return min(fitting, key=lambda p: (self._distance(p, shapes), p))
        raise InvalidInput(self._refusal(shapes))

    def _distance(self, profile: int, shapes: Mapping[str, Shape]) -> int:
        return sum(
            abs(size - best)
            for name, shape in shapes.items()
            for size, best in zip(shape, self.limits[profile][name][1], strict=True)
        )

    def _refusal(self, shapes: Mapping[str, Shape]) -> str:
        for name, shape in shapes.items():
            ranges = [(p, inputs[name]) for p, inputs in self.limits.items()]
            if not any(_fits(shape, limits) for _, limits in ranges):
                if len(ranges) == 1:
                    allowed = f"profile {ranges[0][0]} allows {_range(ranges[0][1])}"
                else:
                    allowed = "profiles allow " + " or ".join(
                        f"{_range(limits)} (profile {p})" for p, limits in ranges
                    )
                return (
                    f"input '{name}' has shape {list(shape)}; the TensorRT engine's "
                    f"optimization {allowed}"
                )
        # Each input fits some profile, but no one profile holds them all.
        each = _join([f"{name} {list(shape)}" for name, shape in shapes.items()])
        allowed = "; ".join(
            f"profile {p} allows " + _join([f"{name} {_range(inputs[name])}" for name in shapes])
            for p, inputs in self.limits.items()
        )
        return (
            f"inputs {each} fit no single optimization profile of the TensorRT engine ({allowed})"
        )


def _fit_all(shapes: Mapping[str, Shape], inputs: Mapping[str, Limits]) -> bool:
    return all(_fits(shape, inputs[name]) for name, shape in shapes.items())


def _fits(shape: Shape, limits: Limits) -> bool:
    low, _, high = limits
    return len(shape) == len(low) and all(
        lo <= size <= hi for size, lo, hi in zip(shape, low, high, strict=True)
    )


def _range(limits: Limits) -> str:
    return f"{list(limits[0])} to {list(limits[2])}"


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
