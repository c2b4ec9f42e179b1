"""Incremental detokenization, stop strings and chat templates, with the tiny GPT-2's byte-level
BPE tokenizer (which splits multi-byte characters across tokens)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from engine.errors import InvalidInput
from engine.generation.text import OFF_LOOP_CHARS, Detokenizer, ModelText
from tests.generative import train_tokenizer


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> ModelText:
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(folder)
    return ModelText(folder)


def stream(text: ModelText, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str]:
    detok = Detokenizer(text, stop)
    deltas = []
    for token in ids:
        deltas.append(detok.push(token))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return deltas, "".join(deltas)


def test_deltas_add_up_to_the_decoded_text(text: ModelText) -> None:
    ids = text.encode("the quick brown fox jumps")
    deltas, joined = stream(text, ids)
    assert joined == "the quick brown fox jumps"
    assert sum(1 for d in deltas if d) > 1  # released as it comes, not only at the end


def test_a_character_split_across_tokens_is_released_whole(text: ModelText) -> None:
    ids = text.encode("naïve 🚀 done")
    deltas, joined = stream(text, ids)
    assert joined == "naïve 🚀 done"
    assert all("\ufffd" not in d for d in deltas)


def test_a_stop_string_across_tokens_ends_the_text_before_it(text: ModelText) -> None:
    ids = text.encode("a batcher merges concurrent requests")
    deltas, joined = stream(text, ids, stop=("merges",))
    assert joined == "a batcher "
    assert not any("mer" in d for d in deltas)


def test_the_earliest_of_two_stops_completed_by_one_token_wins(text: ModelText) -> None:
    ids = text.encode("the quick brown fox")
    assert " quick" in [text.decode([i]) for i in ids]  # "q" and "k" complete in one token
    for stop, before in ((("q", "k"), "the "), (("k", "q"), "the "), (("ick", "u"), "the q")):
        _, joined = stream(text, ids, stop=stop)
        assert joined == before, stop


def test_text_that_might_become_a_stop_string_is_held_back_then_released(
    text: ModelText,
) -> None:
    ids = text.encode("the server answers")
    _, joined = stream(text, ids, stop=("answers!",))
    assert joined == "the server answers"


def test_chat_template_renders_messages(text: ModelText) -> None:
    prompt = text.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "user: hi\nassistant:"


def test_a_template_that_refuses_the_messages_is_invalid_input(tmp_path: Path) -> None:
    train_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidInput, match="first must be user") as refused:
        ModelText(tmp_path).chat_prompt([{"role": "system", "content": "x"}])
    assert refused.value.param == "messages"  # OpenAI's error param


def test_the_template_gets_the_tools_as_transformers_gives_them(tmp_path: Path) -> None:
    train_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools is not none %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% else %}no tools{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    text = ModelText(tmp_path)
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    assert text.chat_prompt([{"role": "user", "content": "x"}], tools) == "[a][b]x"
    assert text.chat_prompt([{"role": "user", "content": "x"}]) == "no tools" + "x"


def test_no_chat_template_points_to_completions(tmp_path: Path) -> None:
    train_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(InvalidInput, match="use /v1/completions"):
        ModelText(tmp_path).chat_prompt([{"role": "user", "content": "x"}])


def test_a_chat_template_beside_the_tokenizer_config_is_read(tmp_path: Path) -> None:
    """transformers 5 saves the template as chat_template.jinja, not in tokenizer_config.json."""
    from tests.genai_models import tiny_gqa_llama_tokenizer

    tiny_gqa_llama_tokenizer(tmp_path)
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    prompt = ModelText(tmp_path).chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "<s>user: hi\nassistant:"


async def test_special_tokens_are_added_as_the_tokenizer_defines_them(tmp_path: Path) -> None:
    """A Llama-style tokenizer's post-processor adds BOS to a prompt, as transformers encodes
    it; a chat prompt's come from its template."""
    from transformers import AutoTokenizer

    from tests.genai_models import tiny_gqa_llama_tokenizer

    tiny_gqa_llama_tokenizer(tmp_path)
    text, hf = ModelText(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    ids = await text.encode_async("the quick", special=True)
    assert ids == hf("the quick").input_ids
    assert ids[0] == hf.bos_token_id
    assert await text.encode_async("the quick") == ids[1:]


def test_each_token_is_decoded_a_bounded_number_of_times(
    text: ModelText, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step decoded the whole sequence, to release what it added: 8,000 tokens took 3.2 s
    of the event loop (4,000: 0.8 s). A step now decodes the last few tokens."""
    ids = text.encode("the quick brown fox jumps over the lazy dog naïve 🚀 " * 40)
    decoded = 0

    def decode(tokens: list[int]) -> str:
        nonlocal decoded
        decoded += len(tokens)
        return real(tokens)

    real = text.decode
    monkeypatch.setattr(text, "decode", decode)
    _, joined = stream(text, ids, stop=("lazy dog!",))
    assert joined == real(ids)
    assert decoded <= 8 * len(ids), decoded / len(ids)


def test_bytes_that_never_make_a_character_are_released_after_a_few_tokens(
    text: ModelText,
) -> None:
    """A model writing bytes that are not UTF-8 (a character's first byte, over and over) is
    not waited on for ever, each step decoding the whole run again: its text goes out as
    U+FFFD, and the text after it as usual."""
    first_byte = text.encode("🚀")[0]
    ids = [first_byte] * 20 + text.encode(" done")
    detok = Detokenizer(text, ())
    deltas = [detok.push(token) for token in ids]
    assert "".join(deltas[:20]).startswith("\ufffd" * 8)
    assert "".join(deltas) + detok.flush() == text.decode(ids) == "\ufffd" * 20 + " done"


class ThreadsSeen:
    """A tokenizer that notes the thread each of its encoding calls runs on."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.threads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._tokenizer, name)
        if not name.startswith("encode"):
            return found

        def noted(*args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.get_ident())
            return found(*args, **kwargs)

        return noted


async def test_a_long_text_is_tokenized_off_the_loop_as_on_it(text: ModelText) -> None:
    """The tokenizer's one-text call holds the GIL (a 2 MB prompt held the event loop 1 s): a
    text past OFF_LOOP_CHARS goes to a worker thread, by the batch call, which lets go of it."""
    long = "the quick brown fox jumps over the lazy dog. " * (OFF_LOOP_CHARS // 40)
    seen = ThreadsSeen(text.tokenizer)
    text.tokenizer, original = seen, text.tokenizer
    try:
        assert await text.encode_async(long) == text.encode(long)
        assert await text.encode_async("the quick") == text.encode("the quick")
    finally:
        text.tokenizer = original
    loop = threading.get_ident()
    assert [thread == loop for thread in seen.threads] == [False, True, True, True]


def test_more_characters_than_the_context_ever_holds_is_a_bound_no_text_reaches(
    text: ModelText,
) -> None:
    tokens = 64
    most = text.most_chars(tokens)
    vocab = text.tokenizer.get_vocab(with_added_tokens=True)
    densest = max(vocab, key=len) * (most // 2)  # the longest token, over and over
    assert len(text.encode(densest[: most + 1])) > tokens
