"""Errors of `sluice convert`. They stay out of `engine/errors.py` on purpose: the server never
imports converters/, and these errors are shown to a person at a terminal, not mapped to a
protocol status.

    ConversionError          a step cannot be done (bad source, unexportable operator, ...)
    └── MissingDependency    a tool the step needs is absent (TensorRT, CUDA GPU, torch, ...)
"""

from __future__ import annotations

from collections.abc import Sequence


class ConversionError(Exception):
    """A conversion step cannot be done; the message says what was received and what is allowed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MissingDependency(ConversionError):
    """The requested step needs software or hardware that this machine does not have."""

    def __init__(self, what: str, missing: Sequence[str]) -> None:
        super().__init__(f"{what} is not possible here: " + "; ".join(missing))
        self.missing = list(missing)
