"""Per-GPU metrics from NVML (the `pynvml` module of nvidia-ml-py, in the `gpu` extra): each
device's utilization and memory, read at scrape time. On a machine without NVML or without an
NVIDIA driver the collector exports nothing, and says why once in the log."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("sluice.metrics.gpu")


class GpuMetrics(Collector):
    """`sluice_gpu_utilization_ratio`, `sluice_gpu_memory_used_bytes` and
    `sluice_gpu_memory_total_bytes`, labelled by device index and name."""

    def __init__(self) -> None:
        # NVML starts at the first scrape, not with the engine: a process that is never scraped
        # never loads it, and the start line stays the log's first.
        self._nvml: Any = None
        self._started = False

    def _start(self) -> Any:
        self._started = True
        try:
            import pynvml

            pynvml.nvmlInit()
        except ImportError:
            log.debug("no per-GPU metrics: nvidia-ml-py is not installed")
        except Exception as exc:  # pynvml.NVMLError: no driver, no device
            log.info("no per-GPU metrics: NVML did not start (%s)", exc)
        else:
            self._nvml = pynvml
        return self._nvml

    def describe(self) -> list[Metric]:
        # Without it, registering the collector would collect (and start NVML) at once.
        return []

    def collect(self) -> Iterator[Metric]:
        nvml = self._nvml if self._started else self._start()
        if nvml is None:
            return
        labels = ["gpu", "name"]
        utilization = GaugeMetricFamily(
            "sluice_gpu_utilization_ratio",
            "Fraction of the last sample period in which a kernel ran on the GPU (NVML).",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "sluice_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=labels
        )
        total = GaugeMetricFamily(
            "sluice_gpu_memory_total_bytes", "GPU memory installed (NVML).", labels=labels
        )
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                name = nvml.nvmlDeviceGetName(handle)
                key = [str(index), name.decode() if isinstance(name, bytes) else str(name)]
                utilization.add_metric(key, nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                used.add_metric(key, memory.used)
                total.add_metric(key, memory.total)
        except nvml.NVMLError as exc:  # a device that fell off the bus must not break /metrics
            log.warning("per-GPU metrics skipped this scrape: %s", exc)
            return
        yield from (utilization, used, total)
