"""batching.errors: the batcher's own errors, and batching/ importing nothing from engine/."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from batching.batcher import Batcher
from batching.errors import BatcherClosed, BatchFailed, BatchingError, QueueFull
from batching.policy import BatchPolicy


def test_batching_imports_nothing_from_engine() -> None:
    code = (
        "import sys, batching.batcher, batching.former, batching.policy, batching.queue, "
        "batching.assembly, batching.cost, batching.deadlines; "
        "print(sorted(m for m in sys.modules if m == 'engine' or m.startswith('engine.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


async def test_a_failed_batch_carries_what_run_batch_raised() -> None:
    cause = KeyError("y")

    async def broken(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise cause

    batcher = Batcher(broken, BatchPolicy(max_batch_size=4, max_queue_delay_s=0.001), label="m")
    with pytest.raises(BatchFailed) as caught:
        await batcher.submit({"x": np.zeros((1, 2), np.float32)}, 1)
    assert caught.value.message == "m failed: KeyError: 'y'"
    assert caught.value.cause is cause
    await batcher.close()
    with pytest.raises(BatcherClosed, match="server is shutting down"):
        await batcher.submit({"x": np.zeros((1, 2), np.float32)}, 1)


def test_every_batching_error_has_its_message() -> None:
    for error in (QueueFull("full"), BatcherClosed("closed"), BatchFailed("failed", ValueError())):
        assert isinstance(error, BatchingError)
        assert error.message == str(error)
    assert QueueFull("full").retry_after_s == 1.0
