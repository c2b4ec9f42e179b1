"""The tokenizer backend: encode and decode with a tokenizer trained in the test, truncation,
bad text, and per-request padding when requests share a batch."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from engine.backends.tokenizer import TokenizerBackend
from engine.engine import Engine
from engine.errors import InvalidInput
from engine.step_config import TokenizerOptions
from engine.types import InferRequest
from server.settings import load_settings
from tests.text_models import SENTENCES, tokenizer_json


def texts(*rows: str | bytes) -> np.ndarray:
    array = np.empty(len(rows), dtype=object)
    array[:] = [row.encode() if isinstance(row, str) else row for row in rows]
    return array


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def backend(path: Path, **options: object) -> TokenizerBackend:
    return TokenizerBackend(path, TokenizerOptions(**options), "model 'tok' version 1")  # type: ignore[arg-type]


def test_encode_matches_the_library_and_pads_to_the_longest_row(tokenizer_file: Path) -> None:
    reference = Tokenizer.from_file(str(tokenizer_file))
    rows = [SENTENCES[0], "fox", SENTENCES[1]]
    out = backend(tokenizer_file).run({"text": texts(*rows)})
    expected = [reference.encode(row).ids for row in rows]
    width = max(map(len, expected))
    assert out["input_ids"].shape == (3, width)
    assert out["input_ids"].dtype == np.int64
    for row, ids in enumerate(expected):
        assert out["input_ids"][row, : len(ids)].tolist() == ids
        assert out["input_ids"][row, len(ids) :].tolist() == [0] * (width - len(ids))  # [PAD]
        assert out["attention_mask"][row].tolist() == [1] * len(ids) + [0] * (width - len(ids))
    assert out["token_type_ids"].tolist() == np.zeros((3, width), np.int64).tolist()
    assert out["truncated"].tolist() == [False, False, False]


def test_specs_describe_text_in_ids_out(tokenizer_file: Path) -> None:
    encode, decode = backend(tokenizer_file), backend(tokenizer_file, direction="decode")
    assert [(s.name, s.datatype, s.shape) for s in encode.inputs] == [("text", "BYTES", (-1,))]
    assert [(s.name, s.datatype, s.shape) for s in encode.outputs] == [
        ("input_ids", "INT64", (-1, -1)),
        ("attention_mask", "INT64", (-1, -1)),
        ("token_type_ids", "INT64", (-1, -1)),
        ("truncated", "BOOL", (-1,)),
    ]
    assert [(s.name, s.datatype) for s in decode.inputs] == [("input_ids", "INT64")]
    assert [(s.name, s.datatype, s.shape) for s in decode.outputs] == [("text", "BYTES", (-1,))]


def test_long_rows_are_cut_to_max_length_and_flagged(tokenizer_file: Path) -> None:
    out = backend(tokenizer_file, max_length=6).run({"text": texts("fox", SENTENCES[0])})
    assert out["input_ids"].shape == (2, 6)
    assert out["truncated"].tolist() == [False, True]
    sep = Tokenizer.from_file(str(tokenizer_file)).token_to_id("[SEP]")
    assert out["input_ids"][1, -1] == sep  # the post-processor's tokens survive the cut


def test_long_rows_without_truncation_are_refused_naming_row_and_length(
    tokenizer_file: Path,
) -> None:
    length = len(Tokenizer.from_file(str(tokenizer_file)).encode(SENTENCES[0]).ids)
    with pytest.raises(InvalidInput) as caught:
        backend(tokenizer_file, max_length=6, truncation=False).run(
            {"text": texts("fox", SENTENCES[0])}
        )
    assert caught.value.message == (
        f"input 'text' row 1 is {length} tokens long; model 'tok' version 1 takes at most "
        "max_length 6 (tokenizer.truncation is false)"
    )


def test_text_that_is_not_utf8_names_input_and_row(tokenizer_file: Path) -> None:
    with pytest.raises(InvalidInput) as caught:
        backend(tokenizer_file).run({"text": texts("fox", b"ok \xff\xfe")})
    assert caught.value.message == (
        "input 'text' row 1 is not valid UTF-8 (invalid start byte at byte 3)"
    )


def test_decode_inverts_encode(tokenizer_file: Path) -> None:
    rows = [SENTENCES[2], "the lazy dog"]
    ids = backend(tokenizer_file).run({"text": texts(*rows)})["input_ids"]
    decoded = backend(tokenizer_file, direction="decode").run({"input_ids": ids})["text"]
    assert [text.decode() for text in decoded] == rows


def test_decode_refuses_ids_outside_the_vocabulary(tokenizer_file: Path) -> None:
    decode = backend(tokenizer_file, direction="decode")
    size = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size()
    with pytest.raises(InvalidInput) as caught:
        decode.run({"input_ids": np.array([[2, 5], [2, size]], np.int64)})
    assert caught.value.message == (
        f"input 'input_ids' row 1 holds token id {size} at position 1; model 'tok' version 1 "
        f"knows ids 0 to {size - 1}"
    )


async def test_requests_sharing_a_batch_are_each_padded_to_their_own_rows(
    tmp_path: Path,
) -> None:
    tokenizer_json(tmp_path / "tok" / "1" / "tokenizer.json")
    (tmp_path / "tok" / "config.yaml").write_text("backend: tokenizer\n")
    engine = Engine(load_settings(model_repository=tmp_path))
    await engine.start()
    try:
        model = engine.registry.resolve("tok", None)
        model.batcher.pause()  # both requests queue, then run as one batch
        short = asyncio.create_task(engine.infer(InferRequest("tok", {"text": texts("fox")}, {})))
        long = asyncio.create_task(
            engine.infer(InferRequest("tok", {"text": texts(SENTENCES[0])}, {}))
        )
        async with asyncio.timeout(10):
            while model.batcher.queue.requests < 2:  # noqa: ASYNC110 (the queue has no event)
                await asyncio.sleep(0.001)
        model.batcher.resume()
        answers = await asyncio.wait_for(asyncio.gather(short, long), 10)
        stats = model.stats.triton("tok", "1")
    finally:
        await engine.close()
    reference = Tokenizer.from_file(str(tmp_path / "tok" / "1" / "tokenizer.json"))
    for answer, text in zip(answers, ["fox", SENTENCES[0]], strict=True):
        assert answer.outputs["input_ids"].tolist() == [reference.encode(text).ids]
    assert [b["batch_size"] for b in stats["batch_stats"]] == [2]


def test_a_file_that_is_not_a_tokenizer_fails_the_load_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text('{"not": "a tokenizer"}')
    with pytest.raises(Exception, match=r"model 'tok' version 1: cannot read tokenizer.json"):
        backend(path)
