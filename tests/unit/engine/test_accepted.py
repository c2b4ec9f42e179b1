"""What the engine settles of a request before admission (engine/accepted.py): its clock and,
for a model never loaded, its rows. Priority levels are tested through the engine
in test_priority.py."""

from __future__ import annotations

import time

import numpy as np

from engine.accepted import MAX_FRONT_END_S, first_axis, request_clock
from engine.types import InferRequest


def test_the_clock_starts_when_the_data_plane_took_the_request_if_it_can_have() -> None:
    before = time.monotonic()
    taken = before - 2.0
    clock = request_clock(taken)
    assert clock.arrived == taken
    assert before <= clock.received <= time.monotonic()  # the statistics count from receipt
    for unbelievable in (None, time.monotonic() + 60.0, before - MAX_FRONT_END_S - 1.0):
        clock = request_clock(unbelievable)
        assert clock.arrived == clock.received  # the engine's own
        assert before <= clock.received <= time.monotonic()


def test_a_request_of_a_model_never_loaded_counts_its_first_input_s_first_axis() -> None:
    def asked(**inputs: np.ndarray) -> InferRequest:
        return InferRequest("m", inputs, dict.fromkeys(inputs, "FP32"))

    assert first_axis(asked(x=np.zeros((3, 4), np.float32), y=np.zeros((9,)))) == 3
    assert first_axis(asked(x=np.ones((), np.float32))) == 1  # no axis
    assert first_axis(asked()) == 1
