"""engine.on_demand_answers: what `on_demand` mode answers for a model not resident, read from
its folder without loading it (readiness, why it is not loaded, an ONNX model's declared
metadata). The answers as the engine gives them, before and after a load, are in
test_on_demand.py."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from engine.demo import mlp_model
from engine.errors import InvalidInput, ModelNotFound, ModelNotReady
from engine.on_demand_answers import NOT_LOADED, NotResidentAnswers
from engine.registry import ModelRegistry
from engine.repository import Repository
from engine.settings import EngineSettings


def answers_for(repo: Path) -> NotResidentAnswers:
    answers = NotResidentAnswers()
    settings = EngineSettings(model_repository=repo, model_control_mode="on_demand")
    answers._books = ModelRegistry(settings, Repository(repo), lambda tenant: 1.0)
    return answers


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """Model `a` (versions 1 and 3 of a small MLP), a Python model and a broken ONNX file."""
    for version in (1, 3):
        (tmp_path / "a" / str(version)).mkdir(parents=True)
        onnx.save(mlp_model((4, 8, 2)), tmp_path / "a" / str(version) / "model.onnx")
    (tmp_path / "a" / "config.yaml").write_text("max_batch_size: 8\nversion_policy: {all: true}\n")
    (tmp_path / "py" / "1").mkdir(parents=True)
    (tmp_path / "py" / "1" / "model.py").write_text("raise SystemExit('never imported')\n")
    (tmp_path / "py" / "config.yaml").write_text(
        "backend: python\npython:\n"
        "  inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]\n"
        "  outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]\n"
    )
    (tmp_path / "torn" / "1").mkdir(parents=True)
    (tmp_path / "torn" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    return tmp_path


def test_a_model_is_loadable_in_the_versions_its_folder_serves(repo: Path) -> None:
    answers = answers_for(repo)
    assert answers.loadable("a", None) is True
    assert [answers.loadable("a", v) for v in ("1", "2", "3", "x", "")] == [
        True, False, True, False, True,
    ]  # fmt: skip
    assert answers.loadable("nope", None) is False
    assert answers.loadable("../a", None) is False  # a name that is not a model name


def test_a_model_whose_last_load_failed_is_not_loadable_and_says_why(repo: Path) -> None:
    answers = answers_for(repo)
    assert str(answers.not_loaded("a", None)) == str(ModelNotReady("a", "latest", NOT_LOADED))
    # The registry records a failed load under (name, version): what the answers read.
    answers._books.failures[("a", "3")] = "InvalidProtobuf: truncated"
    assert answers.loadable("a", "1") is False
    message = str(answers.not_loaded("a", "1"))
    assert message == str(ModelNotReady("a", "1", "failed to load: InvalidProtobuf: truncated"))


async def test_metadata_comes_from_the_files_declared_inputs_and_outputs(repo: Path) -> None:
    answers = answers_for(repo)
    metadata = await answers.metadata("a", None)
    assert (metadata.name, metadata.versions, metadata.platform) == (
        "a", ("1", "3"), "onnxruntime_onnx",
    )  # fmt: skip
    assert [(s.name, s.datatype, s.shape) for s in metadata.inputs] == [("x", "FP32", (-1, 4))]
    assert [(s.name, s.datatype, s.shape) for s in metadata.outputs] == [
        ("probabilities", "FP32", (-1, 2))
    ]
    assert (await answers.metadata("a", "1")).versions == ("1", "3")


async def test_metadata_refusals_name_what_is_missing(repo: Path) -> None:
    answers = answers_for(repo)
    with pytest.raises(ModelNotFound, match=r"^unknown model 'nope'$"):
        await answers.metadata("nope", None)
    with pytest.raises(ModelNotFound, match=r"^unknown version '2' of model 'a'; available: 1, 3$"):
        await answers.metadata("a", "2")
    with pytest.raises(InvalidInput):
        await answers.metadata("a", "../1")
    with pytest.raises(ModelNotReady, match="loads on its first inference request"):
        await answers.metadata("py", None)  # only ONNX files are described before a load
    with pytest.raises(ModelNotReady, match="its model file cannot be read"):
        await answers.metadata("torn", None)
