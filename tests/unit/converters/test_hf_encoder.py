"""`sluice convert` of Hugging Face encoder folders: a sentence-transformers folder becomes
tokenizer -> encoder with pooling and normalization in the graph, a sequence classifier returns
logits and id2label labels; both validated end to end against the source on sample texts and
published as three repository entries. The folders are built in the tests (tests/hf_models.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import Result

from converters.hf_decoder import is_causal_lm_folder
from converters.hf_encoder import is_encoder_folder
from engine.backends.tokenizer import TokenizerBackend
from engine.model_config import load_model_config
from tests.generative import tiny_gpt2
from tests.hf_models import LABELS, MAX_SEQ_LENGTH, sentence_transformer_folder

Convert = Callable[..., Result]
TEXTS = [
    "",
    "dog",
    "the quick brown fox jumps over the lazy dog",
    "a classifier answers with one label per text",
    " ".join(["every step of the pipeline batches its own requests"] * 6),  # > max length
]


def served(repository: Path, name: str, texts: list[str]) -> dict[str, np.ndarray]:
    """Run the published entries the way the pipeline does: sluice's tokenizer step with the
    published config, then the published ONNX model."""
    tokenizer_dir, encoder_dir = repository / f"{name}-tokenizer", repository / f"{name}-encoder"
    options = load_model_config(tokenizer_dir).tokenizer
    tokenizer = TokenizerBackend(tokenizer_dir / "1" / "tokenizer.json", options, "tok")
    tokens = tokenizer.run({"text": np.array(texts, dtype=object)})
    session = ort.InferenceSession(str(encoder_dir / "1" / "model.onnx"))
    feeds = {i.name: tokens[i.name] for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def test_folders_are_told_apart_from_causal_lms(
    st_folder: Path, cls_folder: Path, tmp_path: Path
) -> None:
    gpt2 = tiny_gpt2(tmp_path / "gpt2")
    assert (is_encoder_folder(str(st_folder)), is_causal_lm_folder(str(st_folder))) == (True, False)
    assert (is_encoder_folder(str(cls_folder)), is_causal_lm_folder(str(cls_folder))) == (
        True,
        False,
    )
    assert (is_encoder_folder(str(gpt2)), is_causal_lm_folder(str(gpt2))) == (False, True)
    assert not is_encoder_folder(str(tmp_path))


def test_sentence_transformer_folder_publishes_a_text_pipeline_matching_encode(
    st_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    from sentence_transformers import SentenceTransformer

    result = convert_cli(
        str(st_folder), "--name", "emb", "--repository", tmp_path,
        "--measure-iterations", "2", "--json", tmp_path / "report.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "published"
    steps = {step["name"]: step["detail"] for step in report["steps"]}
    assert steps["measure"] == "2 runs per model and batch size (texts)"
    assert {timing["iterations"] for timing in report["timings"]} == {2}
    assert report["validation"]["passed"]
    assert report["validation"]["samples"] == 32
    pipeline = load_model_config(tmp_path / "emb").pipeline
    assert pipeline is not None
    assert [step.model for step in pipeline.steps] == ["emb-tokenizer", "emb-encoder"]
    assert pipeline.inputs == ["text"]
    assert pipeline.output_names == ["embeddings"]
    tokenizer_config = load_model_config(tmp_path / "emb-tokenizer")
    assert (tokenizer_config.backend, tokenizer_config.tokenizer.max_length) == (
        "tokenizer",
        MAX_SEQ_LENGTH,
    )
    encoder_config = load_model_config(tmp_path / "emb-encoder")
    assert sorted(encoder_config.dynamic_batching.pad) == [
        "attention_mask",
        "input_ids",
        "token_type_ids",
    ]
    session = ort.InferenceSession(str(tmp_path / "emb-encoder" / "1" / "model.onnx"))
    assert [(i.name, i.shape) for i in session.get_inputs()] == [
        (name, ["batch", "seq"]) for name in ("input_ids", "attention_mask", "token_type_ids")
    ]
    want = SentenceTransformer(str(st_folder), device="cpu").encode(TEXTS)
    got = served(tmp_path, "emb", TEXTS)["embeddings"]
    assert got.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)  # Normalize is in


def test_cls_pooling_without_normalize_is_what_the_graph_does(
    tmp_path: Path, convert_cli: Convert
) -> None:
    from sentence_transformers import SentenceTransformer

    folder = sentence_transformer_folder(tmp_path / "cls-st", pooling="cls", normalize=False)
    result = convert_cli(
        str(folder), "--name", "c", "--repository", tmp_path / "repo", "--measure-iterations", "0"
    )
    assert result.exit_code == 0, result.output
    want = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    got = served(tmp_path / "repo", "c", TEXTS)["embeddings"]
    assert not np.allclose(np.linalg.norm(want, axis=1), 1.0)  # really not normalized
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_dense_layer_after_pooling_is_in_the_graph(tmp_path: Path, convert_cli: Convert) -> None:
    from sentence_transformers import SentenceTransformer

    folder = sentence_transformer_folder(tmp_path / "dense-st", dense_features=12)
    result = convert_cli(
        str(folder), "--name", "d", "--repository", tmp_path / "repo", "--measure-iterations", "0"
    )
    assert result.exit_code == 0, result.output
    want = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    got = served(tmp_path / "repo", "d", TEXTS)["embeddings"]
    assert got.shape == (len(TEXTS), 12)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert load_model_config(tmp_path / "repo" / "d").pipeline is not None


def test_a_legacy_lowercasing_folder_is_served_lowercasing(
    tmp_path: Path, convert_cli: Convert
) -> None:
    from sentence_transformers import SentenceTransformer

    # A folder as sentence-transformers 2-4 wrote it (legacy module types and pooling config):
    # its tokenizer.json keeps case and sentence_bert_config.json says do_lower_case, which the
    # library applies at load. The served tokenizer must do what encode does.
    folder = sentence_transformer_folder(tmp_path / "lower-st", do_lower_case=True)
    result = convert_cli(
        str(folder), "--name", "low", "--repository", tmp_path / "repo", "--measure-iterations", "0"
    )
    assert result.exit_code == 0, result.output
    texts = ["The Quick Brown FOX", "the quick brown fox", "DOG"]
    want = SentenceTransformer(str(folder), device="cpu").encode(texts)
    np.testing.assert_allclose(want[0], want[1], atol=1e-6)  # encode ignores case
    assert want.shape == (3, 32)
    np.testing.assert_allclose(
        served(tmp_path / "repo", "low", texts)["embeddings"], want, atol=1e-5
    )


def test_classifier_folder_returns_logits_and_id2label_labels(
    cls_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    result = convert_cli(
        str(cls_folder), "--name", "sent", "--repository", tmp_path, "--measure-iterations", "0"
    )
    assert result.exit_code == 0, result.output
    pipeline = load_model_config(tmp_path / "sent").pipeline
    assert pipeline is not None
    assert pipeline.output_names == ["logits", "labels"]
    model = AutoModelForSequenceClassification.from_pretrained(cls_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(cls_folder)
    with torch.no_grad():
        encoded = tokenizer(TEXTS, padding=True, truncation=True, return_tensors="pt")
        want = model(**encoded).logits.numpy()
    got = served(tmp_path, "sent", TEXTS)
    np.testing.assert_allclose(got["logits"], want, rtol=1e-4, atol=1e-5)
    assert list(got["labels"]) == [LABELS[int(i)] for i in want.argmax(axis=1)]


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_reduced_precisions_pass_their_gates_on_texts(
    st_folder: Path, tmp_path: Path, convert_cli: Convert, precision: str
) -> None:
    result = convert_cli(
        str(st_folder), "--precision", precision, "--dry-run", "--repository", tmp_path,
        "--measure-iterations", "0", "--json", tmp_path / "report.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "not_published"
    (check,) = report["validation"]["outputs"]
    assert check["name"] == "embeddings"
    assert check["passed"]
    assert check["cosine"] >= (0.999 if precision == "fp16" else 0.98)
    assert not list(tmp_path.glob("*/config.yaml"))


def test_failed_validation_publishes_nothing(
    st_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    result = convert_cli(
        str(st_folder), "--atol", "0", "--rtol", "0", "--repository", tmp_path / "repo",
        "--measure-iterations", "0",
    )  # fmt: skip
    assert result.exit_code == 3, result.output
    assert "Validation failed" in result.output
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())


def test_a_folder_without_tokenizer_json_is_refused(
    cls_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((cls_folder / name).read_bytes())
    result = convert_cli(str(folder), "--repository", tmp_path / "repo")
    assert result.exit_code == 1
    assert "has no tokenizer.json" in result.output


@pytest.mark.parametrize("kind", ["classifier", "causal-lm"])
def test_a_folder_that_brings_its_own_code_is_refused_and_its_code_never_runs(
    cls_folder: Path, tmp_path: Path, kind: str
) -> None:
    """config.json's auto_map makes transformers import the folder's own Python: it asked on
    stdin (trust_remote_code unset), so `echo y | sluice convert` ran the folder's code."""
    from click.testing import CliRunner

    from converters.cli import convert

    folder = tmp_path / kind
    if kind == "classifier":
        folder.mkdir()
        for item in cls_folder.iterdir():
            (folder / item.name).write_bytes(item.read_bytes())
    else:
        tiny_gpt2(folder)
    marker = tmp_path / "ran"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                          "AutoModelForCausalLM": "evil.EvilModel",
                          "AutoModelForSequenceClassification": "evil.EvilModel"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(
        convert, [str(folder), "--repository", str(tmp_path / "repo")], input="y\ny\n"
    )
    assert result.exit_code == 1
    assert f"'{folder / 'config.json'}' has auto_map" in result.output
    assert "never runs code from a model folder" in result.output
    assert not marker.exists()
    assert not (tmp_path / "repo").exists()


def test_a_folder_of_another_architecture_is_refused_naming_what_converts(
    tmp_path: Path, convert_cli: Convert
) -> None:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32,
    )  # fmt: skip
    BertModel(config).save_pretrained(str(tmp_path / "bare-bert"))
    result = convert_cli(str(tmp_path / "bare-bert"), "--repository", tmp_path / "repo")
    assert result.exit_code == 1
    assert (
        f"'{tmp_path / 'bare-bert'}' is a Hugging Face folder of BertModel; sluice convert takes "
        "a sentence-transformers folder (modules.json), a *ForSequenceClassification or a "
        "*ForCausalLM"
    ) in " ".join(result.output.split())
