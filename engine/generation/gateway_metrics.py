"""The metrics of the Gateway API Inference Extension's model-server protocol (its proposal 003),
which an inference gateway's endpoint picker scrapes from each replica to route a request: per
generative model (summed over its loaded versions), labelled `model` only, so one
`name{model="..."}` selects it as the picker's metric flags expect.

| protocol metric      | sluice (all gauges)                   | vLLM's                      |
|----------------------|---------------------------------------|-----------------------------|
| TotalQueuedRequests  | `sluice_gateway_queued_requests`      | `vllm:num_requests_waiting` |
| TotalRunningRequests | `sluice_gateway_running_requests`     | `vllm:num_requests_running` |
| KVCacheUtilization   | `sluice_gateway_kv_cache_usage_ratio` | `vllm:kv_cache_usage_perc`  |
| LoRA adapters        | `sluice_gateway_lora_requests_info`   | `vllm:lora_requests_info`   |

Queued are the sequences admitted but not in the decode batch, running those in it (on
onnxruntime-genai: those the Engine has given a token, a prefill's included). The cache usage is a
fraction from 0 to 1, as vLLM's `_perc` is despite its name: the key/value bytes reserved by
sequences over the model's budget. The LoRA family's value is the time of the scrape (the
protocol's "last updated" timestamp: its labels are current then) and its labels the adapters:
none, as no path serves adapters (`max_lora="0"`; docs/guides/generative.md says why)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

PREFIX = "sluice_gateway_"
LORA_LABELS = ["model", "max_lora", "running_lora_adapters", "waiting_lora_adapters"]


class GatewayCollector:
    """Reads `snapshot()["models"]` (LoadedModel) and reports those with a generator."""

    def __init__(
        self, snapshot: Callable[[], dict[str, Any]], clock: Callable[[], float] = time.time
    ) -> None:
        self._snapshot = snapshot
        self._clock = clock

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily(
            f"{PREFIX}queued_requests",
            "Requests admitted and waiting for a place in the decode batch (the inference "
            "gateway's TotalQueuedRequests).",
            labels=["model"],
        )
        running = GaugeMetricFamily(
            f"{PREFIX}running_requests",
            "Requests in the decode batch (the inference gateway's TotalRunningRequests).",
            labels=["model"],
        )
        usage = GaugeMetricFamily(
            f"{PREFIX}kv_cache_usage_ratio",
            "Key/value cache reserved by requests over the model's budget, 0 to 1 (the "
            "inference gateway's KVCacheUtilization).",
            labels=["model"],
        )
        lora = GaugeMetricFamily(
            f"{PREFIX}lora_requests_info",
            "LoRA adapters in its labels (none are served: max_lora 0); the value is the time "
            "of the scrape, as the inference gateway's protocol asks.",
            labels=LORA_LABELS,
        )
        totals: dict[str, list[int]] = {}  # model -> [queued, running, used bytes, budget]
        for model in self._snapshot()["models"]:
            generator = getattr(model, "generator", None)
            if generator is None:
                continue
            scheduler = generator.scheduler
            total = totals.setdefault(model.name, [0, 0, 0, 0])
            total[0] += len(scheduler.waiting)
            total[1] += len(scheduler.running)
            total[2] += scheduler.cache.slot_bytes
            total[3] += scheduler.cache.budget_bytes
        now = self._clock()
        for name, (waiting, batch, used, budget) in sorted(totals.items()):
            queued.add_metric([name], waiting)
            running.add_metric([name], batch)
            usage.add_metric([name], min(1.0, used / budget) if budget > 0 else 0.0)
            lora.add_metric([name, "0", "", ""], now)
        yield from (queued, running, usage, lora)
