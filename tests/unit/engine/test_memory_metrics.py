"""engine/memory_metrics.py: the budget's families read from a real on_demand engine's books."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from engine.demo import write_demo_repository
from engine.engine import Engine
from engine.types import InferRequest
from server.settings import load_settings


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def test_loads_evictions_cold_starts_and_bytes_are_exported(tmp_path: Path) -> None:
    repo = write_demo_repository(tmp_path / "models")
    settings = load_settings(
        model_repository=repo, model_control_mode="on_demand", model_memory={"host_bytes": 1 << 30}
    )
    engine = Engine(settings)
    await engine.start()
    try:
        x = np.ones((1, 16), np.float32)
        await engine.infer(InferRequest("demo", {"x": x}, {"x": "FP32"}))
        found = samples(await engine.metrics.exposition())
        resident = engine.registry.budget.resident_bytes("demo", "1")
        assert resident > 0
        assert found[("sluice_model_resident_bytes", (("model", "demo"), ("version", "1")))] == (
            resident
        )
        assert found[("sluice_memory_resident_bytes", (("device", "host"),))] == resident
        assert found[("sluice_memory_budget_bytes", (("device", "host"),))] == 1 << 30
        loaded = (("model", "demo"), ("outcome", "loaded"))
        assert found[("sluice_model_loads_total", loaded)] == 1
        assert found[("sluice_model_cold_start_seconds_count", ())] == 1
        assert found[("sluice_process_heap_bytes", ())] > resident
        assert engine.registry.on_demand is not None
        await engine.registry.on_demand.evict("demo", "idle")
        found = samples(await engine.metrics.exposition())
        evicted = (("model", "demo"), ("reason", "idle"))
        assert found[("sluice_model_evictions_total", evicted)] == 1
        assert found[("sluice_memory_resident_bytes", (("device", "host"),))] == 0
        assert ("sluice_model_resident_bytes", (("model", "demo"), ("version", "1"))) not in found
    finally:
        await engine.close()
