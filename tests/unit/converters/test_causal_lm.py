"""`sluice convert` of a Hugging Face causal-LM folder: the tiny GPT-2 is exported with its cache
as inputs and outputs, validated against transformers (logits, caches, greedy tokens) and
published as a generative model with its tokenizer files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import Result
from onnx import numpy_helper

from converters.optimize import U8S8_WEIGHT_LIMIT
from engine.model_config import load_model_config
from tests.generative import tiny_gpt2

Convert = Callable[..., Result]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("hf") / "tiny-gpt2")


def test_causal_lm_folder_is_published_as_a_generative_model(
    hf_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    result = convert_cli(str(hf_folder), "--repository", tmp_path, "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    version = tmp_path / "tiny-gpt2" / "1"
    for name in ("model.onnx", "tokenizer.json", "tokenizer_config.json", "conversion.json"):
        assert (version / name).is_file(), name
    config = load_model_config(version.parent)
    assert config.generative is not None
    assert config.generative.context_length == 64
    assert config.generative.eos_token_ids == [0]
    assert config.max_batch_size == 0
    report = json.loads((tmp_path / "r.json").read_text())
    checks = {c["name"]: c for c in report["validation"]["outputs"]}
    assert checks["greedy tokens"]["mismatch"] == 0.0
    assert checks["logits"]["passed"]
    assert checks["present.1.value"]["passed"]
    # Dynamic batch and past: three rows with a 9-position cache run.
    session = ort.InferenceSession(str(version / "model.onnx"))
    past = {i.name: np.zeros((3, 2, 9, 16), np.float32) for i in session.get_inputs()[3:]}
    out = session.run(
        None,
        {
            "input_ids": np.ones((3, 1), np.int64),
            "attention_mask": np.ones((3, 10), np.int64),
            "position_ids": np.full((3, 1), 9, np.int64),
            **past,
        },
    )
    assert out[0].shape == (3, 1, 395)
    assert out[1].shape == (3, 2, 10, 16)


def test_int8_reports_its_greedy_agreement(
    hf_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    result = convert_cli(
        str(hf_folder), "--precision", "int8", "--force", "--repository", tmp_path,
        "--json", tmp_path / "r.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    greedy = next(c for c in report["validation"]["outputs"] if c["name"] == "greedy tokens")
    assert 0 <= greedy["mismatch"] < 0.5  # teacher-forced agreement, not a diverged tail
    model = onnx.load(str(tmp_path / "tiny-gpt2" / "1" / "model.onnx"))
    assert "DynamicQuantizeLinear" in {node.op_type for node in model.graph.node}
    # 7-bit weights: ONNX Runtime's x86 kernels without VNNI cannot saturate (U8S8_WEIGHT_LIMIT).
    weights = [
        numpy_helper.to_array(init).astype(np.int64)
        for init in model.graph.initializer
        if init.data_type == onnx.TensorProto.INT8
    ]
    assert max(int(np.abs(w).max()) for w in weights) == U8S8_WEIGHT_LIMIT


def test_folder_without_tokenizer_json_is_refused(
    hf_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(hf_folder, folder)
    (folder / "tokenizer.json").unlink()
    result = convert_cli(str(folder), "--repository", tmp_path / "repo")
    assert result.exit_code == 1
    assert "has no tokenizer.json" in result.output


def test_a_model_that_picks_end_of_text_first_still_validates(
    hf_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    # The same weights with end-of-text moved to the token the model picks first after the
    # first sample prompt: both sides must stop there (transformers masking it alone made a
    # correct export fail "at token 0").
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from converters.decoder_validation import SAMPLE_PROMPTS

    folder = tmp_path / "early-eos"
    shutil.copytree(hf_folder, folder)
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(SAMPLE_PROMPTS[0]).ids
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(folder)
        first = int(model(torch.tensor([ids])).logits[0, -1].argmax())
    for name in ("config.json", "generation_config.json"):
        settings = json.loads((folder / name).read_text())
        settings["eos_token_id"] = first
        (folder / name).write_text(json.dumps(settings))
    result = convert_cli(
        str(folder), "--repository", tmp_path / "repo", "--json", tmp_path / "r.json"
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    greedy = next(c for c in report["validation"]["outputs"] if c["name"] == "greedy tokens")
    assert (greedy["passed"], greedy["mismatch"]) == (True, 0.0)
    config = load_model_config(tmp_path / "repo" / "early-eos")
    assert config.generative is not None
    assert config.generative.eos_token_ids == [first]
