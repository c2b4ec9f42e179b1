"""The key/value cache manager: one byte budget (`kv_cache_bytes`) shared by the running
sequences of a generative model. A sequence reserves a slot for its prompt plus its completion
at admission (so a running sequence never runs out of room mid-stream), waits while that does
not fit, and gives the bytes back when it finishes, is cancelled or its client goes away."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The decoder's cache per token: layers x (key, value) x kv_heads x head_dim floats."""

    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int = 4

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize


@dataclass(eq=False)
class Slot:
    """One sequence's cache: `kv[j]` is tensor j (layer j // 2, key or value) as
    [kv_heads, capacity, head_dim]; positions below `length` hold valid entries."""

    capacity: int
    kv: np.ndarray
    length: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = self.kv.nbytes


class KVCacheManager:
    """Hands out slots within `budget_bytes`; never blocks (a slot that does not fit is None)."""

    def __init__(self, layout: CacheLayout, budget_bytes: int) -> None:
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        """Bytes in use: sequences' slots and blocks taken by the prefix cache."""
        self.slot_bytes = 0
        """Bytes of sequences' slots alone."""
        self.slots = 0

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.layout.bytes_per_token

    def fits_ever(self, tokens: int) -> bool:
        """Whether a slot of `tokens` fits in an empty cache."""
        return self.bytes_for(tokens) <= self.budget_bytes

    def reserve(self, tokens: int) -> Slot | None:
        """A slot for `tokens` positions, or None while the budget has no room for it."""
        if self.used_bytes + self.bytes_for(tokens) > self.budget_bytes:
            return None
        layout = self.layout
        kv = np.empty((2 * layout.layers, layout.kv_heads, tokens, layout.head_dim), np.float32)
        slot = Slot(tokens, kv)
        self.used_bytes += slot.nbytes
        self.slot_bytes += slot.nbytes
        self.slots += 1
        return slot

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def take(self, nbytes: int) -> bool:
        """Account `nbytes` held outside slots (the prefix cache's blocks) if they fit."""
        if nbytes > self.free_bytes:
            return False
        self.used_bytes += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """Give back bytes taken with `take`."""
        self.used_bytes -= nbytes

    def release(self, slot: Slot) -> None:
        """Give a slot's bytes back (once; a second release is ignored)."""
        if slot.nbytes:
            self.used_bytes -= slot.nbytes
            self.slot_bytes -= slot.nbytes
            self.slots -= 1
            slot.nbytes = 0
