"""The Gateway API Inference Extension's model-server metrics on a real `sluice serve`, scraped
from /metrics and parsed as Prometheus text: the protocol's names and types for a model on
onnxruntime-genai (the tiny GQA Llama) and one on sluice's own scheduler (the tiny GPT-2), one
series per model, and what they read once a completion is done."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.generative import copy_tiny
from tests.servers import ServerProcess

GAUGES = [
    "sluice_gateway_queued_requests",
    "sluice_gateway_running_requests",
    "sluice_gateway_kv_cache_usage_ratio",
    "sluice_gateway_lora_requests_info",
]


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_gpt2_built: tuple[Path, Path],
    tiny_genai_built: tuple[Path, Path],
) -> Iterator[ServerProcess]:
    from tests.genai_models import publish_genai

    root = tmp_path_factory.mktemp("gateway")
    _, models = copy_tiny(tiny_gpt2_built, root)  # "tiny", on sluice's scheduler
    publish_genai(tiny_genai_built[1], models)  # "llama", on onnxruntime-genai
    process = ServerProcess(
        "--model-repository", str(models), log_path=root / "server.log", grpc=False
    ).start(timeout_s=90)
    yield process
    process.stop()


def scrape(server: ServerProcess) -> dict[str, Any]:
    reply = httpx.get(f"{server.url}/metrics", timeout=5)
    assert reply.status_code == 200, reply.text
    return {family.name: family for family in text_string_to_metric_families(reply.text)}


def test_each_generative_model_has_the_protocols_gauges(server: ServerProcess) -> None:
    for model in ("tiny", "llama"):
        body = {"model": model, "prompt": "the quick", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
    families = scrape(server)
    for name in GAUGES:
        assert families[name].type == "gauge", name
        models = sorted(sample.labels["model"] for sample in families[name].samples)
        assert models == ["llama", "tiny"], name  # one series per model, versions summed
    for name in GAUGES[:3]:  # nothing in flight once the completions are answered
        assert {s.labels["model"]: s.value for s in families[name].samples} == {
            "llama": 0.0, "tiny": 0.0
        }, name  # fmt: skip
    for sample in families["sluice_gateway_lora_requests_info"].samples:
        assert sample.labels["max_lora"] == "0"
        assert sample.labels["running_lora_adapters"] == ""
        assert sample.labels["waiting_lora_adapters"] == ""
        assert sample.value > 1.7e9  # a Unix time: the protocol's "last updated" timestamp


def requests_total(server: ServerProcess) -> dict[tuple[str, str], float]:
    """sluice_requests_total of the model "tiny" over HTTP, by (version, status)."""
    family = scrape(server)["sluice_requests"]
    return {
        (s.labels["version"], s.labels["status"]): s.value
        for s in family.samples
        if s.name == "sluice_requests_total"
        and (s.labels["model"], s.labels["protocol"]) == ("tiny", "http")
    }


def test_generation_requests_are_counted_once_by_the_data_plane(server: ServerProcess) -> None:
    """Each generation request, whichever route, is one count with its status, as inference
    is: a stream when it ends, a refusal when it is refused."""
    before = requests_total(server)
    body = {"model": "tiny", "prompt": "the quick", "max_tokens": 3, "temperature": 0}
    sent = [
        ("/v1/completions", body | {"n": 2}, 200),
        ("/v1/completions", body | {"stream": True}, 200),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400),
        ("/v2/models/tiny/generate", {"text_input": "the", "max_tokens": 2}, 200),
    ]
    for path, payload, status in sent:
        reply = httpx.post(f"{server.url}{path}", json=payload, timeout=30)
        assert reply.status_code == status, reply.text
    after = requests_total(server)
    grown = {key: after[key] - before.get(key, 0.0) for key in after}
    assert {key: n for key, n in grown.items() if n} == {("", "200"): 3.0, ("", "400"): 1.0}
