"""`sluice convert` of a Llama-family folder through onnxruntime-genai's model builder: the tiny
GQA Llama with a BOS-adding tokenizer (tests/genai_models.py) converts, validates greedy-identical
to transformers with BOS on both sides (fp32) or within the agreement bound (int4), and is
published as a folder the server runs on onnxruntime-genai."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result

from converters.genai_convert import MIN_AGREEMENT, SAMPLE_PROMPTS, builder_architecture


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.genai_models import tiny_gqa_llama

    return tiny_gqa_llama(tmp_path_factory.mktemp("llama") / "hf")


def test_the_builder_takes_llama_not_gpt2(llama: Path, tmp_path: Path) -> None:
    from tests.generative import tiny_gpt2

    assert builder_architecture(llama)
    assert not builder_architecture(tiny_gpt2(tmp_path / "gpt2"))


def test_fp32_is_greedy_identical_with_bos_and_published_for_genai(
    llama: Path, tmp_path: Path, convert_cli: Callable[..., Result]
) -> None:
    from engine.generation.genai import is_genai_folder

    report = tmp_path / "report.json"
    result = convert_cli(llama, "--repository", tmp_path / "models", "--name", "llama",
                         "--json", report)  # fmt: skip
    assert result.exit_code == 0, result.output
    body = json.loads(report.read_text())
    check = body["validation"]["outputs"][0]
    assert (check["name"], check["mismatch"], check["passed"]) == ("greedy tokens", 0.0, True)
    assert body["validated_on"] == "onnxruntime-genai"
    version = tmp_path / "models" / "llama" / "1"
    assert is_genai_folder(version)
    assert (version / "model.onnx.data").is_file()
    assert (version / "chat_template.jinja").is_file()


def test_greedy_validation_feeds_bos_to_both_sides(llama: Path) -> None:
    """A validation that left BOS out on both sides passed a model served with BOS untested:
    the sample prompts are encoded as the tokenizer encodes them, BOS first."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama)
    assert all(tokenizer(p).input_ids[0] == tokenizer.bos_token_id for p in SAMPLE_PROMPTS)


def test_int4_reports_its_agreement_rate(
    llama: Path, tmp_path: Path, convert_cli: Callable[..., Result]
) -> None:
    report = tmp_path / "report.json"
    result = convert_cli(llama, "--repository", tmp_path / "models", "--precision", "int4",
                         "--json", report, "--dry-run")  # fmt: skip
    body = json.loads(report.read_text())
    check = body["validation"]["outputs"][0]
    assert check["name"] == "next-token agreement"
    assert check["mismatch"] is not None
    assert check["passed"] == (check["mismatch"] <= 1 - MIN_AGREEMENT)
    assert result.exit_code == (0 if check["passed"] else 3), result.output


def test_int4_is_refused_for_a_model_the_builder_does_not_take(
    tmp_path: Path, convert_cli: Callable[..., Result]
) -> None:
    from tests.generative import tiny_gpt2

    folder = tiny_gpt2(tmp_path / "gpt2")
    result = convert_cli(folder, "--repository", tmp_path / "models", "--precision", "int4")
    assert result.exit_code != 0
    assert "--precision int4 is for causal LMs onnxruntime-genai's model builder" in result.output
