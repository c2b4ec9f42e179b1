"""How one model version's requests are batched: `BatchPolicy`, the settings a Batcher is built
with (the engine makes one from each model's config).

Apart from the batcher so that both of its halves, `batching.batcher` (queueing, running and
answering) and `batching.former` (forming each batch from the queue), read it without importing
each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from batching.assembly import Padding

AUTO = "auto"
"""`max_queue_delay_s` that plans each batch window from deadlines and the fitted batch cost."""


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """How one model version's requests are batched. `max_batch_size` 0 runs each request alone."""

    max_batch_size: int
    max_queue_delay_s: float | Literal["auto"] = 0.002
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 4096
    priority_levels: int = 1
    instances: int = 1
    padding: Mapping[str, Padding] = field(default_factory=dict)
    pad_bucket_ratio: float = 1.5
    dispatch_when_idle: bool = True
    latency_target_s: float | None = None
    """With delay "auto": the deadline, counted from arrival, of requests that set no timeout."""

    @property
    def auto(self) -> bool:
        return self.max_queue_delay_s == AUTO

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0
