"""Counting the Python bytecode instructions a call runs: a deterministic measure of work done in
Python (C code runs none), for tests that a cost does not grow a Python step per value."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def bytecodes_run(func: Callable[[], object]) -> int:
    """How many Python bytecode instructions `func()` runs."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        count += event == "opcode"
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        func()
    finally:
        sys.settrace(previous)
    return count
