"""Prometheus families of the memory budget (engine.budget): what each resident version measured,
loads, evictions and cold starts by model, the load queues, and the books against the budgets
and the allocator's own count. Read at scrape time from the registry's books; every family is
exported in every mode (samples only where there is something to count)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from engine.budget import MemoryBudget
from engine.memory import heap_bytes


def memory_families(memory: dict[str, Any] | None) -> Iterator[Metric]:
    """The families, filled from `ModelRegistry.memory()` (None before the engine started)."""
    resident = GaugeMetricFamily(
        "sluice_model_resident_bytes",
        "Measured host bytes of each loaded version (the allocator's growth across its load).",
        labels=["model", "version"],
    )
    loads = CounterMetricFamily(
        "sluice_model_loads",
        "Loads of a model on demand (on_demand mode), by outcome (loaded, failed).",
        labels=["model", "outcome"],
    )
    evictions = CounterMetricFamily(
        "sluice_model_evictions",
        "Models unloaded by the memory budget, by reason (budget: room for another load; "
        "idle: idle_unload_s; changed: files changed, too large to reload beside the old).",
        labels=["model", "reason"],
    )
    cold = HistogramMetricFamily(
        "sluice_model_cold_start_seconds",
        "Seconds from a request finding its model not resident to the model serving (load, "
        "warm-up and any evictions it needed).",
    )
    queued = GaugeMetricFamily(
        "sluice_model_load_queue_depth",
        "Requests waiting for a model's load now (models with none are not listed).",
        labels=["model"],
    )
    budget_bytes = GaugeMetricFamily(
        "sluice_memory_budget_bytes",
        "The budget per device (host, gpu<N>): model_memory.host_bytes and gpu_bytes.",
        labels=["device"],
    )
    accounted = GaugeMetricFamily(
        "sluice_memory_resident_bytes",
        "Measured bytes of every loaded version together, per device (the budget's books).",
        labels=["device"],
    )
    heap = GaugeMetricFamily(
        "sluice_process_heap_bytes",
        "Bytes the C allocator holds for the process now (glibc mallinfo2): the books follow "
        "its growth across loads.",
    )
    if memory is not None:
        books: MemoryBudget = memory["budget"]
        for (model, version), cost in list(books.costs.items()):
            resident.add_metric([model, version], cost.host_bytes)
        for model, usage in list(books.usage.items()):
            if usage.loads or usage.load_failures:
                loads.add_metric([model, "loaded"], usage.loads)
                loads.add_metric([model, "failed"], usage.load_failures)
            for reason, count in usage.evictions.items():
                evictions.add_metric([model, reason], count)
        cold.add_metric([], books.cold_start.cumulative(), books.cold_start.total)
        for model, waiting in memory["queued"].items():
            queued.add_metric([model], waiting)
        accounted.add_metric(["host"], books.host_used())
        for device, used in books.gpu_used().items():
            accounted.add_metric([f"gpu{device}"], used)
        if books.host_limit is not None:
            budget_bytes.add_metric(["host"], books.host_limit)
        if books.gpu_limit is not None:
            for device in books.gpu_used() or {0: 0}:
                budget_bytes.add_metric([f"gpu{device}"], books.gpu_limit)
        heap.add_metric([], heap_bytes())
    yield from (resident, loads, evictions, cold, queued, budget_bytes, accounted, heap)
