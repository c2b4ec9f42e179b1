"""engine.queries: the engine's answers about models rather than with them (metadata, input
checks, readiness, config, statistics), over a real Engine and a small repository."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine
from engine.errors import InvalidInput, ModelNotFound
from engine.queries import EXTENSIONS, VERSION
from engine.types import InferRequest
from server.settings import load_settings
from tests.models import identity_model, write_model

ALL_VERSIONS = "version_policy: {all: true}\nwarmup: {enabled: false}\n"


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    for version in (2, 10):  # 10 after 2: versions sort as numbers, not text
        write_model(tmp_path, "m", identity_model("FP32"), ALL_VERSIONS, version=version)
    engine = Engine(load_settings(model_repository=tmp_path, grpc_enabled=False))
    await engine.start()
    yield engine
    await engine.close()


def test_server_metadata_lists_the_extensions() -> None:
    regions = load_settings(grpc_enabled=False, shared_memory={"enabled": True})
    plain = Engine(load_settings(grpc_enabled=False)).server_metadata()
    assert plain == {"name": "sluice", "version": VERSION, "extensions": EXTENSIONS}
    with_shm = Engine(regions).server_metadata()["extensions"]
    assert with_shm == [*EXTENSIONS, "system_shared_memory"]


def test_a_query_before_the_start_says_so() -> None:
    with pytest.raises(RuntimeError, match="engine not started"):
        _ = Engine(load_settings(grpc_enabled=False)).registry


async def test_model_metadata_lists_versions_in_numeric_order(engine: Engine) -> None:
    meta = await engine.model_metadata("m")
    assert meta.versions == ("2", "10")
    assert meta.platform == "onnxruntime_onnx"
    assert [spec.as_dict() for spec in meta.inputs] == [
        {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}
    ]
    with pytest.raises(ModelNotFound, match="unknown model 'nope'"):
        await engine.model_metadata("nope")


async def test_the_input_check_is_the_models_and_refuses_before_decoding(engine: Engine) -> None:
    check = engine.cached_input_check("m")
    assert check is not None
    assert check is await engine.input_check("m")
    check({"INPUT0": (1, 4)}, {"INPUT0": "FP32"})  # fits: nothing raised
    with pytest.raises(InvalidInput, match="INPUT0"):
        check({"INPUT0": (1, 5)}, {"INPUT0": "FP32"})


async def test_readiness_per_version_and_while_draining(engine: Engine) -> None:
    assert await engine.model_ready("m")
    assert await engine.model_ready("m", "2")
    assert not await engine.model_ready("m", "3")
    assert not await engine.model_ready("nope")
    engine.stop_accepting()
    assert not await engine.model_ready("m")


async def test_config_says_where_it_came_from(engine: Engine) -> None:
    config = await engine.model_config("m")
    assert config["name"] == "m"
    assert config["parameters"]["sluice_config_source"] == {"string_value": "repository"}


async def test_statistics_per_model_and_version(engine: Engine) -> None:
    request = InferRequest("m", {"INPUT0": np.ones((1, 4), np.float32)}, {"INPUT0": "FP32"})
    await engine.infer(request)
    every = (await engine.statistics())["model_stats"]
    assert sorted((s["name"], s["version"]) for s in every) == [("m", "10"), ("m", "2")]
    (latest,) = (await engine.statistics("m", "10"))["model_stats"]
    assert latest["inference_count"] == 1
    (older,) = (await engine.statistics("m", "2"))["model_stats"]
    assert older["inference_count"] == 0


async def test_metrics_label_a_model_only_once_it_is_known(engine: Engine) -> None:
    assert engine.label_for("m") == "m"
    assert engine.label_for("anything a client sends") == "_unknown"


async def test_the_repository_index(engine: Engine) -> None:
    index = await engine.repository_index()
    assert sorted((e["name"], e["version"], e["state"]) for e in index) == [
        ("m", "10", "READY"),
        ("m", "2", "READY"),
    ]
