"""The Gateway API Inference Extension's model-server metrics: the protocol's types, one series
per generative model (its versions summed), the cache usage as a fraction, the LoRA family's
labels and timestamp value."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.generation.gateway_metrics import GatewayCollector


def generative(name: str, version: str, running: int, waiting: int, used: int, budget: int) -> Any:
    scheduler = SimpleNamespace(
        running=[object()] * running,
        waiting=[object()] * waiting,
        cache=SimpleNamespace(slot_bytes=used, budget_bytes=budget),
    )
    return SimpleNamespace(
        name=name, version=version, generator=SimpleNamespace(scheduler=scheduler)
    )


def scrape(models: list[Any]) -> dict[str, Any]:
    registry = CollectorRegistry()
    registry.register(GatewayCollector(lambda: {"models": models}, clock=lambda: 1234.5))
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_each_generative_model_has_the_protocols_gauges() -> None:
    tensor_model = SimpleNamespace(name="resnet", version="1", generator=None)
    families = scrape([
        generative("llama", "1", running=4, waiting=2, used=400, budget=400),
        generative("llama", "2", running=1, waiting=0, used=100, budget=400),
        generative("gpt2", "1", running=0, waiting=0, used=0, budget=1000),
        tensor_model,
    ])  # fmt: skip
    assert {name: family.type for name, family in families.items()} == {
        "sluice_gateway_queued_requests": "gauge",
        "sluice_gateway_running_requests": "gauge",
        "sluice_gateway_kv_cache_usage_ratio": "gauge",
        "sluice_gateway_lora_requests_info": "gauge",
    }

    def values(name: str) -> dict[str, float]:
        return {s.labels["model"]: s.value for s in families[name].samples}

    assert values("sluice_gateway_queued_requests") == {"llama": 2, "gpt2": 0}
    assert values("sluice_gateway_running_requests") == {"llama": 5, "gpt2": 0}
    assert values("sluice_gateway_kv_cache_usage_ratio") == {"llama": 500 / 800, "gpt2": 0.0}
    (lora, _) = families["sluice_gateway_lora_requests_info"].samples
    assert lora.labels == {
        "model": "gpt2", "max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""
    }  # fmt: skip
    assert lora.value == 1234.5


def test_no_generative_model_no_series_and_a_zero_budget_is_no_usage() -> None:
    families = scrape([])
    assert all(not family.samples for family in families.values())
    families = scrape([generative("tiny", "1", running=0, waiting=0, used=0, budget=0)])
    (usage,) = families["sluice_gateway_kv_cache_usage_ratio"].samples
    assert usage.value == 0.0
