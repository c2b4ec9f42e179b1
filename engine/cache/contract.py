"""What every cache backend shares: the cached value, the async contract and the counters.

Arrays handed out by a cache are read-only views (writing to them, or flipping them writeable,
raises ValueError), so one stored result can be shared by every hit without copying and no caller
can change what the next caller reads. A caller that needs to modify outputs copies them first
(`copy_outputs`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from engine.types import TensorSpec


@dataclass(frozen=True, slots=True)
class CachedResult:
    """The outputs of one request and their v2 datatypes (BYTES: object arrays of `bytes`)."""

    outputs: Mapping[str, np.ndarray]
    datatypes: Mapping[str, str]

    @property
    def nbytes(self) -> int:
        """Bytes of array data held (BYTES: the total length of the elements)."""
        return sum(array_nbytes(array) for array in self.outputs.values())


@dataclass(frozen=True, slots=True)
class Expected:
    """What a result must be to answer one request: exactly these outputs, each of its datatype
    and of a shape that fits (-1 fits any length). An entry read from Redis is checked against it
    before it is served, so one that another writer planted (valid CRC, wrong outputs or rows) or
    that another build of the model wrote is a miss, never an answer."""

    outputs: Mapping[str, tuple[str, tuple[int, ...]]]
    """Output name -> (datatype, shape)."""

    @classmethod
    def for_outputs(
        cls, specs: Sequence[TensorSpec], names: Collection[str] | None, rows: int | None
    ) -> Expected:
        """The outputs `names` (None: all) of a model with output `specs`, for a request of
        `rows` rows (None for a model without a batch dimension)."""
        outputs: dict[str, tuple[str, tuple[int, ...]]] = {}
        for spec in specs:
            if names is None or spec.name in names:
                shape = spec.shape if rows is None else (rows, *spec.shape[1:])
                outputs[spec.name] = (spec.datatype, tuple(shape))
        return cls(outputs)

    def mismatch(self, result: CachedResult) -> str | None:
        """Why `result` cannot answer the request (what it holds, what was expected), or None."""
        if set(result.outputs) != set(self.outputs) or set(result.datatypes) != set(self.outputs):
            return f"outputs {sorted(result.outputs)}; expected {sorted(self.outputs)}"
        for name, (datatype, shape) in self.outputs.items():
            if result.datatypes[name] != datatype:
                return f"output '{name}' is {result.datatypes[name]}; expected {datatype}"
            got = result.outputs[name].shape
            if len(got) != len(shape) or any(
                want not in (-1, have) for have, want in zip(got, shape, strict=True)
            ):
                return f"output '{name}' has shape {list(got)}; expected {list(shape)}"
        return None


@dataclass(slots=True)
class CacheStats:
    """Monotonic counters plus two gauges (`bytes`, `entries`); read them at scrape time.

    For Redis, `bytes` and `entries` stay 0: the shared store's size is Redis's own business
    (INFO memory), not something one replica can count.
    """

    hits: int = 0
    misses: int = 0
    errors: int = 0
    """Failed or timed-out backend calls and corrupt entries (each also counted as a miss)."""
    evictions: int = 0
    """Entries dropped to stay under the byte bound."""
    expirations: int = 0
    """Entries found past their TTL (memory backend)."""
    stores: int = 0
    """Results stored (for Redis: writes that completed)."""
    skipped: int = 0
    """Results not stored: larger than the entry limit, or too many writes already pending."""
    rejected: int = 0
    """Entries read from Redis and refused: corrupt, unsigned or wrongly signed (with a signing
    key), larger than the entry limit, or not fitting the request (each also an error and a
    miss)."""
    bytes: int = 0
    entries: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name, for the statistics endpoint and the metrics exporter."""
        return asdict(self)


@runtime_checkable
class ResultCache(Protocol):
    """One async contract for the memory, Redis and tiered backends.

    No method raises because of the backend: a failure is a miss (get) or a skipped store (put),
    counted in `stats`. Cancelling a call is always safe.
    """

    @property
    def stats(self) -> CacheStats:
        """Counters of this cache (tiered: the combined view)."""
        ...

    async def get(self, key: bytes, expected: Expected | None = None) -> CachedResult | None:
        """The result stored under `key`, or None. Its arrays are read-only. An entry read from
        Redis that does not fit `expected` is a miss (memory holds only results this process
        computed or checked)."""
        ...

    async def put(self, key: bytes, result: CachedResult, ttl_s: float) -> None:
        """Store a copy of `result` for `ttl_s` seconds; the caller keeps ownership of its arrays.

        The local (memory) part is visible to `get` when this returns; a Redis write completes in
        the background (see `flush`), so a slow Redis never delays a reply.
        """
        ...

    async def flush(self) -> None:
        """Wait until background writes issued so far have finished (or failed)."""
        ...

    async def close(self) -> None:
        """Finish pending writes (each bounded by the Redis timeout) and release connections."""
        ...


def array_nbytes(array: np.ndarray) -> int:
    """Bytes of data in `array`; for object (BYTES) arrays, the summed element lengths."""
    if array.dtype.kind == "O":
        return sum(len(item) for item in array.ravel().tolist())
    return int(array.nbytes)


def frozen_copy(result: CachedResult) -> CachedResult:
    """A private copy of `result` whose arrays nobody else references and nobody can write."""
    outputs: dict[str, np.ndarray] = {}
    for name, array in result.outputs.items():
        owned = np.array(array, copy=True, order="C")
        owned.setflags(write=False)
        outputs[name] = owned
    return CachedResult(outputs, dict(result.datatypes))


def read_only_views(result: CachedResult) -> CachedResult:
    """Views of a stored result's arrays: cheap to hand out, impossible to make writeable."""
    return CachedResult(
        {name: array.view() for name, array in result.outputs.items()}, result.datatypes
    )


def copy_outputs(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Writeable copies of `outputs`, e.g. for a coalesced caller that must own its arrays."""
    return {name: np.array(array, copy=True) for name, array in outputs.items()}


def copy_result(result: CachedResult) -> CachedResult:
    """`result` with writeable copies of its arrays (a `Coalescer` clone function)."""
    return CachedResult(copy_outputs(result.outputs), dict(result.datatypes))
