"""An online model of what one batch costs on this machine: seconds = per_batch + per_row * rows.

The batcher feeds it every batch it runs (assembly, compute and split together, as the caller
waits for all three) and asks it how long a batch of n rows will take. The fit is least squares
with exponential forgetting, so it follows the machine as load, threads and neighbours change:
an observation's weight halves every `half_life` batches. A batch slower than STALL_FACTOR times
its prediction counts as that much: a stall (the core taken by a neighbour, a GC pause) says
nothing about the model, and averaged in whole one such batch would more than double the fit
for the next `half_life` batches, so the batcher would shed requests that could have made it.
A machine that really slowed is still followed: each batch may raise the fit by that factor.

The fit is a mean over the last ~`half_life` batches, so it lags a machine that just sped up (a
neighbour left the core). `fastest` is the least a batch may take: the prediction scaled by the
fastest of the last RECENT batches against theirs. The batcher sheds on it, as shedding cannot
be undone: a request answered 504 that the model would have served in time is lost.
"""

from __future__ import annotations

import math
from collections import deque

MIN_BATCHES = 3
"""Batches seen before the model predicts anything (`predict` is None until then)."""
STALL_FACTOR = 3.0
"""An observation counts as at most this many times its prediction (see the module docstring)."""
RECENT = 8
"""Batches whose time against their prediction `fastest` remembers."""


class BatchCost:
    """Recency-weighted linear fit of batch time against rows. Not thread-safe: the batcher
    feeds it from the event loop."""

    def __init__(self, half_life: float = 64.0) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self._keep = math.exp(math.log(0.5) / half_life)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.batches = 0
        """Batches observed in all."""
        self._ratios: deque[float] = deque(maxlen=RECENT)  # recent batches: seconds / predicted

    def observe(self, rows: int, seconds: float) -> None:
        """One batch of `rows` rows took `seconds`; negative or non-finite times are ignored, and
        one slower than STALL_FACTOR predictions counts as that many."""
        if rows < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        predicted = self.predict(rows)
        if predicted is not None and predicted > 0:
            self._ratios.append(seconds / predicted)
            seconds = min(seconds, predicted * STALL_FACTOR)
        keep = self._keep
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + rows
        self._y = self._y * keep + seconds
        self._xx = self._xx * keep + rows * rows
        self._xy = self._xy * keep + rows * seconds
        self.batches += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(per_batch_s, per_row_s), both >= 0; None before MIN_BATCHES batches. With one batch
        size seen so far (a saturated queue sends only full batches) the cost is taken as all per
        row: the slope cannot be told apart yet, and guessing smaller batches cheaper lets them
        be tried, which is what teaches the slope."""
        if self.batches < MIN_BATCHES:
            return None
        mean_x = self._x / self._w
        mean_y = self._y / self._w
        spread = self._xx / self._w - mean_x * mean_x
        if spread <= 1e-9 * max(1.0, mean_x * mean_x):
            return 0.0, mean_y / mean_x
        slope = (self._xy / self._w - mean_x * mean_y) / spread
        # A flat curve, its noise or its rounding: the batch costs the same whatever its rows.
        if slope <= 1e-9 * mean_y / mean_x:
            return mean_y, 0.0
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # all cost scales with rows: fit through the origin instead
            return 0.0, self._xy / self._xx
        return intercept, slope

    def predict(self, rows: int) -> float | None:
        """Predicted seconds for a batch of `rows` rows; None until the model has seen enough."""
        fitted = self.coefficients()
        if fitted is None:
            return None
        per_batch, per_row = fitted
        return per_batch + per_row * rows

    def fastest(self, rows: int) -> float | None:
        """The least a batch of `rows` rows may take: `predict`, scaled by the fastest of the last
        RECENT batches against their predictions (never above `predict`); None when it is."""
        predicted = self.predict(rows)
        if predicted is None:
            return None
        return predicted * min([1.0, *self._ratios])

    def rows_within(self, seconds: float) -> int | None:
        """The most rows a batch can hold and still be predicted to finish within `seconds` (0
        when not even one row can); None when there is no such bound: rows cost nothing, or
        nothing is fitted yet."""
        fitted = self.coefficients()
        if fitted is None or fitted[1] <= 0:
            return None if fitted is None or seconds >= fitted[0] else 0
        per_batch, per_row = fitted
        return max(0, math.floor((seconds - per_batch) / per_row))
