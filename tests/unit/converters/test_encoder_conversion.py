"""converters.encoder_conversion: `sluice convert` of a Hugging Face encoder folder refuses the
options of other sources and an existing version before writing anything, and validates on
sample texts of every kind (the conversions end to end: test_hf_encoder.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from click.testing import Result

from converters.encoder_conversion import WORDS, sample_texts
from converters.hf_encoder import load_encoder

Convert = Callable[..., Result]


def test_options_of_other_sources_are_refused_naming_them(
    st_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    result = convert_cli(
        str(st_folder), "--input", "x:FP32:-1,4", "--pad", "x:1:0", "--repository", tmp_path
    )
    assert result.exit_code == 1
    assert "--input, --pad do not apply to a Hugging Face encoder folder" in result.output


def test_an_existing_version_is_refused_before_anything_is_written(
    st_folder: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    (tmp_path / "emb-encoder" / "1").mkdir(parents=True)
    result = convert_cli(
        str(st_folder), "--name", "emb", "--version", "1", "--repository", tmp_path,
        "--measure-iterations", "0",
    )  # fmt: skip
    assert result.exit_code == 1
    assert "version 1 of model 'emb-encoder' already exists" in result.output
    assert not (tmp_path / "emb-tokenizer").exists()  # the step before it was not written either
    assert not (tmp_path / "emb").exists()


def test_sample_texts_span_empty_to_past_the_models_limit(st_folder: Path) -> None:
    source = load_encoder(st_folder)
    texts = sample_texts(source, 8, seed=1)
    assert len(texts) == 8
    assert {"", "hello"} <= set(texts)
    lengths = [len(source.tokenizer(t, truncation=False)["input_ids"]) for t in texts]
    assert max(lengths) > source.max_length  # truncation is validated too
    assert len(set(lengths)) >= 5  # a spread of lengths, not one
    assert all(word in WORDS for text in texts for word in text.split() if text != "hello")
    assert sample_texts(source, 8, seed=1) == texts
    assert sample_texts(source, 8, seed=2) != texts
    assert len(sample_texts(source, 1, seed=1)) == 3  # always an empty, a short and a long one
