"""Counters and recent latencies of one generative model's scheduler (the metrics read them)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RECENT = 10_000


@dataclass
class GenerationStats:
    """Generated tokens and steps since load; the latest TTFT and inter-token gaps, seconds."""

    generated_tokens: int = 0
    steps: int = 0
    time_to_first_token_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    inter_token_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
