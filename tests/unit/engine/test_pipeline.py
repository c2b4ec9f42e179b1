"""Pipelines in the engine: tokenizer -> ONNX embedding -> Python normalization, each step batched
by its own batcher; metadata, Triton config, per-step statistics, errors naming the step, rows
truncated, and a step reloaded under a running pipeline."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer

from engine.engine import Engine
from engine.errors import BackendError, DeadlineExceeded, InvalidInput, ModelNotReady
from engine.model_config import ModelConfig
from engine.types import InferRequest
from server.settings import load_settings
from tests.text_models import (
    DIM,
    embedding_sum_model,
    embedding_table,
    expected_embeddings,
    write_text_repository,
)

FOUR = ["the quick brown fox", "the lazy dog jumps", "text goes in here", "answers come out now"]


def texts(*rows: str | bytes) -> np.ndarray:
    array = np.empty(len(rows), dtype=object)
    array[:] = [row.encode() if isinstance(row, str) else row for row in rows]
    return array


def ask(*rows: str | bytes, model: str = "embedder") -> InferRequest:
    return InferRequest(model, {"TEXT": texts(*rows)}, {"TEXT": "BYTES"})


def reference(repo: Path) -> Tokenizer:
    return Tokenizer.from_file(str(repo / "tok" / "1" / "tokenizer.json"))


async def start(repo: Path, **settings: object) -> Engine:
    engine = Engine(load_settings(model_repository=repo, allow_python_models=True, **settings))
    await engine.start()
    return engine


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    engine = await start(write_text_repository(tmp_path / "models"))
    yield engine
    await engine.close()


async def queued(engine: Engine, model: str, count: int) -> None:
    queue = engine.registry.resolve(model, None).batcher.queue
    async with asyncio.timeout(10):  # a bounded poll: the queue has no event to wait on
        while queue.requests < count:  # noqa: ASYNC110
            await asyncio.sleep(0.001)


async def test_text_in_embeddings_out_as_computed_in_process(
    engine: Engine, tmp_path: Path
) -> None:
    rows = ["the quick brown fox", "text goes in and answers come out", "dog"]
    answer = await engine.infer(ask(*rows))
    assert list(answer.outputs) == ["EMBEDDING"]
    assert answer.datatypes == {"EMBEDDING": "FP32"}
    expected = expected_embeddings(tmp_path / "models", rows)
    np.testing.assert_allclose(answer.outputs["EMBEDDING"], expected, rtol=1e-5, atol=1e-6)
    tokens = sum(len(e.ids) for e in reference(tmp_path / "models").encode_batch(rows))
    assert answer.parameters == {"tokens": tokens}  # nothing was truncated


async def test_metadata_and_triton_config_describe_the_pipeline(engine: Engine) -> None:
    metadata = await engine.model_metadata("embedder")
    assert metadata.platform == "ensemble"
    assert [s.as_dict() for s in metadata.inputs] == [
        {"name": "TEXT", "datatype": "BYTES", "shape": [-1]}
    ]
    assert [s.as_dict() for s in metadata.outputs] == [
        {"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, DIM]}
    ]
    config = await engine.model_config("embedder")
    assert config["platform"] == "ensemble"
    assert config["input"] == [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": []}]
    assert config["output"] == [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [DIM]}]
    assert "dynamic_batching" not in config
    assert config["ensemble_scheduling"]["step"] == [
        {"model_name": "tok", "model_version": -1, "input_map": {"text": "TEXT"},
         "output_map": {"input_ids": "ids", "attention_mask": "mask"}},
        {"model_name": "embed", "model_version": -1,
         "input_map": {"input_ids": "ids", "attention_mask": "mask"},
         "output_map": {"embedding": "raw"}},
        {"model_name": "norm", "model_version": -1, "input_map": {"x": "raw"},
         "output_map": {"y": "EMBEDDING"}},
    ]  # fmt: skip


async def test_every_stage_batches_concurrent_pipeline_requests(engine: Engine) -> None:
    steps = ["tok", "embed", "norm"]
    batchers = {name: engine.registry.resolve(name, None).batcher for name in steps}
    for batcher in batchers.values():
        batcher.pause()
    tasks = [asyncio.create_task(engine.infer(ask(text))) for text in FOUR]
    for name in steps:  # each stage holds all four, then sends them as one batch
        await queued(engine, name, 4)
        batchers[name].resume()
    answers = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [a.outputs["EMBEDDING"].shape for a in answers] == [(1, DIM)] * 4
    stats = {s["name"]: s for s in (await engine.statistics())["model_stats"]}
    for name in steps:
        assert [b["batch_size"] for b in stats[name]["batch_stats"]] == [4], name
        assert stats[name]["inference_stats"]["success"]["count"] == 4, name
    assert stats["embedder"]["inference_stats"]["success"]["count"] == 4
    assert stats["embedder"]["execution_count"] == 4  # the pipeline runs each request alone


async def test_the_request_deadline_reaches_the_steps(engine: Engine) -> None:
    embed = engine.registry.resolve("embed", None).batcher
    embed.pause()  # the request waits at step 2, past its timeout
    request = ask("the lazy dog")
    request.timeout_s = 0.05
    try:
        with pytest.raises(DeadlineExceeded) as caught:
            await asyncio.wait_for(engine.infer(request), 10)
    finally:
        embed.resume()
    assert caught.value.message.startswith("pipeline 'embedder' step 2 ('embed'): request waited ")
    assert embed.queue.requests == 0  # withdrawn from the step's queue, never run


async def test_bad_text_fails_only_its_own_request_naming_step_and_row(engine: Engine) -> None:
    tok = engine.registry.resolve("tok", None).batcher
    tok.pause()
    good = asyncio.create_task(engine.infer(ask("the lazy dog")))
    bad = asyncio.create_task(engine.infer(ask("fine", b"\xc3\x28")))
    await queued(engine, "tok", 2)
    tok.resume()
    assert (await asyncio.wait_for(good, 10)).outputs["EMBEDDING"].shape == (1, DIM)
    with pytest.raises(InvalidInput) as caught:
        await asyncio.wait_for(bad, 10)
    assert caught.value.message == (
        "pipeline 'embedder' step 1 ('tok'): input 'text' row 1 is not valid UTF-8 "
        "(invalid continuation byte at byte 0)"
    )


async def test_truncated_rows_are_counted_in_the_response(tmp_path: Path) -> None:
    repo = write_text_repository(
        tmp_path / "models", "backend: tokenizer\ntokenizer: {max_length: 5}\n"
    )
    engine = await start(repo)
    try:
        rows = ["dog", "the quick brown fox jumps", "the lazy dog jumps"]
        answer = await engine.infer(ask(*rows))
    finally:
        await engine.close()
    lengths = [len(t.ids) for t in reference(repo).encode_batch(rows)]
    assert lengths[0] <= 5 < min(lengths[1:])
    # The tokens the model was given: the long rows cut to max_length.
    assert answer.parameters == {"truncated_rows": 2, "tokens": lengths[0] + 5 + 5}
    assert answer.outputs["EMBEDDING"].shape == (3, DIM)


async def test_too_long_text_without_truncation_is_a_400_naming_step_and_row(
    tmp_path: Path,
) -> None:
    config = "backend: tokenizer\ntokenizer: {max_length: 5, truncation: false}\n"
    engine = await start(write_text_repository(tmp_path / "models", config))
    try:
        with pytest.raises(InvalidInput) as caught:
            await engine.infer(ask("dog", "the quick brown fox jumps"))
    finally:
        await engine.close()
    length = len(reference(tmp_path / "models").encode("the quick brown fox jumps").ids)
    assert caught.value.message == (
        f"pipeline 'embedder' step 1 ('tok'): input 'text' row 1 is {length} tokens long; model "
        "'tok' version 1 takes at most max_length 5 (tokenizer.truncation is false)"
    )


async def test_a_step_that_does_not_truncate_refuses_a_long_row(tmp_path: Path) -> None:
    repo = write_text_repository(
        tmp_path / "models", "backend: tokenizer\ntokenizer: {max_length: 5}\n"
    )
    config = (repo / "embedder" / "config.yaml").read_text()
    config = config.replace(
        "outputs: {input_ids: ids, attention_mask: mask}",
        "outputs: {input_ids: ids, attention_mask: mask}\n      truncation: false",
    )
    (repo / "embedder" / "config.yaml").write_text(config)
    engine = await start(repo)
    try:
        short = await engine.infer(ask("dog"))
        with pytest.raises(InvalidInput) as caught:
            await engine.infer(ask("dog", "the quick brown fox jumps"))
    finally:
        await engine.close()
    assert short.outputs["EMBEDDING"].shape == (1, DIM)
    assert caught.value.message == (
        "pipeline 'embedder' step 1 ('tok'): input 'TEXT' row 1 is longer than the 5 tokens "
        "model 'tok' takes, and this step does not truncate (truncation: false)"
    )


PICKY_PY = """
import numpy as np


class Picky:
    def load(self, config):
        self.unk = int(config["parameters"]["unk"])

    def infer(self, inputs):
        ids = inputs["input_ids"]
        if (ids == self.unk).any():
            raise ValueError("an unknown token reached the picky step")
        return {"count": (ids > 0).sum(axis=1).astype(np.int64)}
"""


async def test_a_step_that_fails_mid_pipeline_fails_only_the_requests_that_broke_it(
    tmp_path: Path,
) -> None:
    repo = write_text_repository(tmp_path / "models")
    (repo / "picky" / "1").mkdir(parents=True)
    (repo / "picky" / "1" / "model.py").write_text(PICKY_PY)
    (repo / "picky" / "config.yaml").write_text(
        "backend: python\npython:\n  parameters: {unk: 1}\n"  # [UNK] is id 1
        "  inputs: [{name: input_ids, datatype: INT64, shape: [-1, -1]}]\n"
        "  outputs: [{name: count, datatype: INT64, shape: [-1]}]\n"
        "dynamic_batching: {pad: {input_ids: {axis: 1}}, pad_bucket_ratio: 4}\n"
    )
    (repo / "counter").mkdir()
    (repo / "counter" / "config.yaml").write_text(
        "pipeline:\n  steps:\n"
        "    - {model: tok, inputs: {text: TEXT}, outputs: {input_ids: ids}}\n"
        "    - {model: picky, inputs: {input_ids: ids}, outputs: {count: COUNT}}\n"
    )
    engine = await start(repo)
    try:
        picky = engine.registry.resolve("picky", None)
        picky.batcher.pause()
        good = asyncio.create_task(engine.infer(ask("the lazy dog", model="counter")))
        bad = asyncio.create_task(engine.infer(ask("the € dog", model="counter")))
        await queued(engine, "picky", 2)
        picky.batcher.resume()
        answer = await asyncio.wait_for(good, 10)
        with pytest.raises(BackendError) as caught:
            await asyncio.wait_for(bad, 10)
        stats = picky.stats.triton("picky", "1")
    finally:
        await engine.close()
    assert answer.outputs["COUNT"].tolist() == [len(reference(repo).encode("the lazy dog").ids)]
    assert caught.value.message == (
        "pipeline 'counter' step 2 ('picky'): model 'picky' version 1 failed: ValueError: an "
        "unknown token reached the picky step"
    )
    assert stats["inference_stats"]["fail"]["count"] == 1
    assert stats["inference_stats"]["success"]["count"] == 1


async def test_a_step_reloaded_under_a_running_pipeline(tmp_path: Path) -> None:
    repo = write_text_repository(tmp_path / "models")
    engine = await start(repo, model_control_mode="explicit", load_models=["embedder"])
    try:
        assert engine.registry.has("tok")  # loaded as steps of the pipeline asked for
        assert engine.registry.has("embed")
        old = engine.registry.resolve("embed", None)
        old.batcher.pause()
        in_flight = asyncio.create_task(engine.infer(ask("the lazy dog")))
        await queued(engine, "embed", 1)
        vocab = reference(repo).get_vocab_size()
        model = embedding_sum_model(embedding_table(vocab, seed=1))  # other weights
        onnx.save(model, repo / "embed" / "1" / "model.onnx")
        reload = asyncio.create_task(engine.load_model("embed"))
        async with asyncio.timeout(10):
            while engine.registry.resolve("embed", None) is old:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        after = await engine.infer(ask("the lazy dog"))  # the new version serves new requests
        old.batcher.resume()  # the old one finishes what it holds, then is retired
        before = await asyncio.wait_for(in_flight, 10)
        await asyncio.wait_for(reload, 10)
    finally:
        await engine.close()
    expected_old = expected_embeddings(repo, ["the lazy dog"])
    np.testing.assert_allclose(before.outputs["EMBEDDING"], expected_old, rtol=1e-5, atol=1e-6)
    assert not np.allclose(after.outputs["EMBEDDING"], expected_old, atol=1e-3)


async def test_a_pipeline_whose_step_is_missing_fails_to_load_naming_it(tmp_path: Path) -> None:
    repo = write_text_repository(tmp_path / "models")
    config = (repo / "embedder" / "config.yaml").read_text().replace("model: norm", "model: nrm")
    (repo / "embedder" / "config.yaml").write_text(config)
    engine = await start(repo, strict_readiness=False)
    try:
        with pytest.raises(ModelNotReady) as caught:
            await engine.infer(ask("dog"))
    finally:
        await engine.close()
    assert "pipeline 'embedder' step 3 ('nrm'): unknown model 'nrm'" in caught.value.message


async def test_a_step_mapping_that_does_not_fit_its_model_fails_the_load(tmp_path: Path) -> None:
    repo = write_text_repository(tmp_path / "models")
    config = (repo / "embedder" / "config.yaml").read_text().replace("{x: raw}", "{z: raw}")
    (repo / "embedder" / "config.yaml").write_text(config)
    engine = await start(repo, strict_readiness=False)
    try:
        reason = [r["reason"] for r in await engine.repository_index() if r["name"] == "embedder"]
    finally:
        await engine.close()
    assert reason == [
        "ValueError: pipeline 'embedder' step 3 ('norm'): inputs maps ['z']; model 'norm' takes "
        "['x']"
    ]


@pytest.mark.parametrize(
    ("pipeline", "message"),
    [
        (
            {"steps": [{"model": "a", "inputs": {"x": "X"}, "outputs": {"y": "Y"}},
                       {"model": "b", "inputs": {"x": "X"}, "outputs": {"y": "Y"}}]},
            "pipeline tensor 'Y' is produced by step 1 and step 2 ('b')",
        ),
        (
            {"steps": [{"model": "a", "inputs": {"x": "X"}, "outputs": {"y": "Y"}}],
             "outputs": ["Z"]},
            "pipeline output 'Z' is produced by no step",
        ),
        (
            {"steps": [{"model": "a", "inputs": {"x": "X", "w": "W"}, "outputs": {"y": "Y"}},
                       {"model": "b", "inputs": {"x": "Y"}, "outputs": {"y": "W"}}]},
            "pipeline steps 'a', 'b' wait on each other's outputs (a cycle)",
        ),
    ],
)  # fmt: skip
def test_pipeline_config_errors_name_the_problem(pipeline: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(pipeline=pipeline)  # type: ignore[arg-type]


def test_a_pipeline_refuses_the_result_cache_pointing_at_its_steps() -> None:
    # Its answers change when a step is reloaded, which its own cache key would not see.
    steps = [{"model": "a", "inputs": {"x": "X"}, "outputs": {"y": "Y"}}]
    with pytest.raises(ValidationError, match="enable the cache on its steps instead"):
        ModelConfig(pipeline={"steps": steps}, cache={"enabled": True})  # type: ignore[arg-type]


def test_a_pipeline_needs_no_version_folder_but_may_have_them(tmp_path: Path) -> None:
    from engine.repository import Repository

    repo = write_text_repository(tmp_path / "models")
    repository = Repository(repo)
    assert repository.is_pipeline("embedder")
    assert not repository.is_pipeline("tok")
    entry = repository.entry("embedder")
    assert entry is not None
    assert entry.versions == {1: repo / "embedder" / "config.yaml"}
    for version in ("2", "3"):
        (repo / "embedder" / version).mkdir()  # empty, as Triton's ensembles have them
    entry = repository.entry("embedder")
    assert entry is not None
    assert list(entry.versions) == [3]  # the version policy applies: latest 1


async def test_poll_mode_picks_up_a_changed_step_under_the_pipeline(tmp_path: Path) -> None:
    repo = write_text_repository(tmp_path / "models")
    engine = await start(repo, model_control_mode="poll", poll_interval_s=0.05)
    try:
        pipeline = engine.registry.resolve("embedder", None)
        first = await engine.infer(ask("the lazy dog"))
        table = embedding_table(reference(repo).get_vocab_size(), seed=2)
        path = repo / "embed" / "1" / "model.onnx"
        onnx.save(embedding_sum_model(table), path)
        async with asyncio.timeout(20):  # bounded: the poller reloads `embed` on its own
            for bump in itertools.count(1):
                answer = await engine.infer(ask("the lazy dog"))
                if not np.allclose(answer.outputs["EMBEDDING"], first.outputs["EMBEDDING"]):
                    break
                # The poller's first scan may postdate the save: a newer mtime is a change.
                os.utime(path, ns=(time.time_ns() + bump, time.time_ns() + bump))
                await asyncio.sleep(0.02)
        assert engine.registry.resolve("embedder", None) is pipeline  # the pipeline stayed
    finally:
        await engine.close()
    raw = table[reference(repo).encode("the lazy dog").ids].sum(axis=0)
    np.testing.assert_allclose(
        answer.outputs["EMBEDDING"][0], raw / np.linalg.norm(raw), rtol=1e-5, atol=1e-6
    )


async def test_a_pipeline_that_failed_for_want_of_a_step_loads_once_the_step_does(
    tmp_path: Path,
) -> None:
    repo = write_text_repository(tmp_path / "models")
    good = (repo / "embed" / "1" / "model.onnx").read_bytes()
    (repo / "embed" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    engine = await start(
        repo, model_control_mode="explicit", load_models=["embedder"], strict_readiness=False
    )
    try:
        assert not await engine.model_ready("embed")
        assert not await engine.model_ready("embedder")
        (repo / "embed" / "1" / "model.onnx").write_bytes(good)
        await engine.load_model("embed")  # only the step: its pipeline follows by itself
        answer = await engine.infer(ask("the lazy dog"))
    finally:
        await engine.close()
    expected = expected_embeddings(repo, ["the lazy dog"])
    np.testing.assert_allclose(answer.outputs["EMBEDDING"], expected, rtol=1e-5, atol=1e-6)


async def test_a_pipeline_is_not_ready_while_a_step_is_unloaded(tmp_path: Path) -> None:
    repo = write_text_repository(tmp_path / "models")
    engine = await start(repo, model_control_mode="explicit", load_models=["embedder"])
    try:
        assert await engine.model_ready("embedder")
        await engine.unload_model("embed")
        assert not await engine.model_ready("embed")
        assert not await engine.model_ready("embedder")  # its requests would fail in that step
        await engine.load_model("embed")
        assert await engine.model_ready("embedder")
    finally:
        await engine.close()
