"""Per-GPU metrics through NVML, against a fake pynvml with the real signatures."""

from __future__ import annotations

import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.gpu_metrics import GpuMetrics
from engine.metrics import Metrics
from tests.fakes import pynvml as fake_nvml


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> list[fake_nvml.Device]:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml)
    devices = [
        fake_nvml.Device("NVIDIA H100 80GB HBM3", 75, 30 << 30, 80 << 30),
        fake_nvml.Device("NVIDIA H100 80GB HBM3", 0, 1 << 20, 80 << 30),
    ]
    monkeypatch.setattr(fake_nvml, "DEVICES", devices)
    monkeypatch.setattr(fake_nvml, "_started", False)
    return devices


def scrape(collector: GpuMetrics) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_each_gpu_reports_utilization_and_memory(nvml: list[fake_nvml.Device]) -> None:
    registry = scrape(GpuMetrics())
    name = "NVIDIA H100 80GB HBM3"
    values = {
        (metric, gpu): registry.get_sample_value(metric, {"gpu": gpu, "name": name})
        for metric in ("sluice_gpu_utilization_ratio", "sluice_gpu_memory_used_bytes",
                       "sluice_gpu_memory_total_bytes")
        for gpu in ("0", "1")
    }  # fmt: skip
    assert values == {
        ("sluice_gpu_utilization_ratio", "0"): 0.75,
        ("sluice_gpu_utilization_ratio", "1"): 0.0,
        ("sluice_gpu_memory_used_bytes", "0"): 30 << 30,
        ("sluice_gpu_memory_used_bytes", "1"): 1 << 20,
        ("sluice_gpu_memory_total_bytes", "0"): 80 << 30,
        ("sluice_gpu_memory_total_bytes", "1"): 80 << 30,
    }


def test_without_nvml_there_are_no_gpu_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert "sluice_gpu" not in generate_latest(scrape(GpuMetrics())).decode()


def test_a_failing_device_skips_the_scrape_without_breaking_it(
    nvml: list[fake_nvml.Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = GpuMetrics()
    assert "sluice_gpu" in generate_latest(scrape(collector)).decode()  # NVML started
    monkeypatch.setattr(fake_nvml, "_started", False)  # as after a driver reset
    assert "sluice_gpu" not in generate_latest(scrape(collector)).decode()


def test_the_engine_metrics_include_the_gpus(nvml: list[fake_nvml.Device]) -> None:
    metrics = Metrics(lambda: {"models": [], "index": [], "in_flight": 0})
    assert 'sluice_gpu_memory_total_bytes{gpu="1"' in generate_latest(metrics.registry).decode()


def test_nvml_that_does_not_start_gives_no_gpu_metrics(
    nvml: list[fake_nvml.Device], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_driver() -> None:
        raise fake_nvml.NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED

    monkeypatch.setattr(fake_nvml, "nvmlInit", no_driver)
    assert "sluice_gpu" not in generate_latest(scrape(GpuMetrics())).decode()
