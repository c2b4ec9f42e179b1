"""The batcher tests' fake run_batch (tests/unit/batching/recorder.py) as a fixture."""

from __future__ import annotations

import pytest

from tests.unit.batching.recorder import Recorder


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()
