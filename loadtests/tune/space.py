"""What `sluice tune` may change in a model's config, as ordered axes of a small search space.

A candidate is the original config with up to five values replaced: `max_batch_size` (powers of
two), `dynamic_batching.max_queue_delay_s` (a few fixed delays, or `auto` planning against the
SLO), `dynamic_batching.preferred_batch_sizes` (none, half the batch, or a quarter and a half),
`instances` and `onnxruntime.intra_op_threads` (their product bounded by the cores). When tune
owns the server (`--serve-cmd`), the server's front-end `workers` are one more axis: a server
setting, not model config, so it never appears in a candidate's config.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

DELAYS_S: tuple[float, ...] = (0.0, 0.0005, 0.001, 0.002, 0.004)
"""The fixed delays tried, shortest first (auto is tried beside them)."""
AUTO = "auto"
PREFERRED = ("none", "half", "quarter+half")
"""preferred_batch_sizes as a share of max_batch_size ("original": as the config has it)."""
ORIGINAL = "original"
MAX_BATCH = 256

Delay = float | str


@dataclass(frozen=True, slots=True)
class Candidate:
    """One point of the space; `preferred` "original" keeps the config's own list."""

    max_batch_size: int
    max_queue_delay_s: Delay
    preferred: str
    instances: int
    intra_op_threads: int
    workers: int | None = None
    """Front-end worker processes the server runs with; None: not searched (the server's own)."""

    @property
    def key(self) -> str:
        """A stable name (results.json and resume match candidates by it)."""
        delay = self.max_queue_delay_s
        shown = delay if isinstance(delay, str) else f"{delay * 1e3:g}ms"
        return (
            f"b{self.max_batch_size}-d{shown}-p{self.preferred}-i{self.instances}"
            f"-t{self.intra_op_threads}{'' if self.workers is None else f'-w{self.workers}'}"
        )

    def describe(self) -> str:
        delay = self.max_queue_delay_s
        shown = delay if isinstance(delay, str) else f"{delay * 1e3:g} ms"
        return (
            f"max_batch_size {self.max_batch_size}, delay {shown}, preferred {self.preferred}, "
            f"instances {self.instances}, threads {self.intra_op_threads}"
            + ("" if self.workers is None else f", workers {self.workers}")
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        return cls(
            max_batch_size=int(data["max_batch_size"]),
            max_queue_delay_s=data["max_queue_delay_s"],
            preferred=str(data["preferred"]),
            instances=int(data["instances"]),
            intra_op_threads=int(data["intra_op_threads"]),
            workers=None if data.get("workers") is None else int(data["workers"]),
        )


def preferred_sizes(code: str, max_batch_size: int) -> list[int]:
    """The preferred_batch_sizes a code stands for at `max_batch_size`."""
    if code == "half" and max_batch_size >= 2:
        return [max_batch_size // 2]
    if code == "quarter+half" and max_batch_size >= 4:
        return [max_batch_size // 4, max_batch_size // 2]
    return []


@dataclass(frozen=True, slots=True)
class Space:
    """The original config and the values each axis may take, in their order."""

    original: dict[str, Any]
    """The model's config as written (sluice's config.yaml schema)."""
    baseline: Candidate
    """The original config's effective values."""
    batch_sizes: tuple[int, ...]
    delays: tuple[Delay, ...]
    preferred: tuple[str, ...]
    instances: tuple[int, ...]
    cores: int
    slo_s: float
    tune_threads: bool = True
    workers: tuple[int, ...] = ()
    """Front-end worker counts to try (empty: the server is not tune's to restart)."""

    def threads(self, instances: int) -> tuple[int, ...]:
        """Intra-op thread counts worth trying beside `instances` (their product <= cores)."""
        if not self.tune_threads:
            return (self.baseline.intra_op_threads,)
        return tuple(range(1, max(1, self.cores // instances) + 1))

    def axes(self, current: Candidate) -> list[tuple[str, Sequence[Any], bool]]:
        """(field, values, ordered) in search order; values depend on `current` where coupled."""
        axes: list[tuple[str, Sequence[Any], bool]] = []
        # Workers first: each value tried costs a server restart, and once chosen every later
        # trial runs on it without one.
        if len(self.workers) > 1:
            axes.append(("workers", self.workers, True))
        if len(self.batch_sizes) > 1:
            axes.append(("max_batch_size", self.batch_sizes, True))
        if len(self.delays) > 1:
            axes.append(("max_queue_delay_s", self.delays, True))
        if len(self.preferred) > 1:
            axes.append(("preferred", self.preferred, False))
        if len(self.instances) > 1:
            axes.append(("instances", self.instances, True))
        threads = self.threads(current.instances)
        if len(threads) > 1:
            axes.append(("intra_op_threads", threads, True))
        return axes

    def fit(self, candidate: Candidate) -> Candidate:
        """`candidate` with threads cut to what its instances leave of the cores."""
        threads = self.threads(candidate.instances)
        if candidate.intra_op_threads in threads:
            return candidate
        return replace(candidate, intra_op_threads=max(threads))

    def grid_size(self) -> int:
        """Candidates in the full grid (what a naive search would run)."""
        pairs = sum(len(self.threads(count)) for count in self.instances)
        grid = len(self.batch_sizes) * len(self.delays) * len(self.preferred) * pairs
        return grid * max(1, len(self.workers))

    def config(self, candidate: Candidate) -> dict[str, Any]:
        """The original config with the candidate's values in place (workers are the server's,
        not the model's: they change nothing here)."""
        if replace(candidate, workers=self.baseline.workers) == self.baseline:
            return copy.deepcopy(self.original)
        config = copy.deepcopy(self.original)
        config["max_batch_size"] = candidate.max_batch_size
        batching = config.setdefault("dynamic_batching", {})
        batching["max_queue_delay_s"] = candidate.max_queue_delay_s
        if candidate.max_queue_delay_s == AUTO:
            batching["latency_target_s"] = self.slo_s
        else:
            batching.pop("latency_target_s", None)
        if candidate.preferred != ORIGINAL:
            batching["preferred_batch_sizes"] = preferred_sizes(
                candidate.preferred, candidate.max_batch_size
            )
        else:
            kept = [s for s in batching.get("preferred_batch_sizes", [])]
            batching["preferred_batch_sizes"] = [s for s in kept if s <= candidate.max_batch_size]
        if isinstance(config.get("instances", 1), int):
            config["instances"] = candidate.instances
        if config.get("backend", "onnxruntime") == "onnxruntime":
            config.setdefault("onnxruntime", {})["intra_op_threads"] = candidate.intra_op_threads
        return config


def build_space(
    original: dict[str, Any],
    triton: dict[str, Any],
    cores: int,
    slo_ms: float,
    request_rows: int = 1,
    workers: Sequence[int] = (),
    served_workers: int | None = None,
) -> Space:
    """The space around a model: `original` is its sluice config, `triton` the server's Triton
    model config (for the effective max_batch_size and delay the server filled in); `workers`
    the front-end worker counts to try when tune owns the server, which it started with
    `served_workers`."""
    max_batch = int(triton.get("max_batch_size", 0))
    batching = triton.get("dynamic_batching") or {}
    written = (original.get("dynamic_batching") or {}).get("max_queue_delay_s")
    delay: Delay = (
        written if written is not None else batching.get("max_queue_delay_microseconds", 2000) / 1e6
    )
    groups = isinstance(original.get("instances", 1), list)
    # Instance groups (GPUs, say) are kept as written; the count is shown, not searched.
    instances = (
        sum(int(group.get("count", 1)) for group in original["instances"])
        if groups
        else int(original.get("instances", 1))
    )
    onnx = original.get("backend", "onnxruntime") == "onnxruntime"
    threads = int((original.get("onnxruntime") or {}).get("intra_op_threads", 1)) if onnx else 1
    searched = tuple(sorted({*workers, served_workers})) if workers and served_workers else ()
    baseline = Candidate(
        max_batch, delay, ORIGINAL, instances, threads, served_workers if searched else None
    )
    if max_batch > 0 and batching:
        limit = max(MAX_BATCH, max_batch)
        sizes = sorted({2**k for k in range(20) if request_rows <= 2**k <= limit} | {max_batch})
        fixed = sorted({*DELAYS_S, *([delay] if isinstance(delay, float | int) else [])})
        delays: tuple[Delay, ...] = (*fixed, AUTO)
        preferred: tuple[str, ...] = (ORIGINAL, *PREFERRED)
    else:  # unbatched: only instances and threads can change
        sizes, delays, preferred = [max_batch], (delay,), (ORIGINAL,)
    counts = (instances,) if groups else tuple(range(1, max(cores, instances) + 1))
    return Space(
        original=original,
        baseline=baseline,
        batch_sizes=tuple(sizes),
        delays=delays,
        preferred=preferred,
        instances=counts,
        cores=max(1, cores),
        slo_s=slo_ms / 1e3,
        tune_threads=onnx,
        workers=searched,
    )


def effective(config: dict[str, Any]) -> str:
    """What `config` means once sluice fills in its defaults (so `preferred_batch_sizes: []`
    and no such key are the same), as JSON; the config as written when sluice refuses it."""
    from pydantic import ValidationError

    from engine.model_config import ModelConfig

    try:
        return ModelConfig(**config).model_dump_json()
    except (ValidationError, TypeError):
        return config_json(config)


def config_json(config: dict[str, Any]) -> str:
    """The JSON a load request's `config` parameter carries."""
    return json.dumps(config, sort_keys=True)
