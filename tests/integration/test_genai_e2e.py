"""Generation on onnxruntime-genai end to end: a real `sluice serve` with the tiny GQA Llama
(tests/genai_models.py) as onnxruntime-genai's model builder wrote it, called with the real
`openai` client. Greedy completions must be token-identical to transformers `generate` from the
same ids, BOS included (the Hugging Face tokenizer's post-processor adds it on both sides)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.genai_models import CONTEXT, reference_greedy
from tests.generative import SENTENCES
from tests.servers import ServerProcess

PROMPTS = [*SENTENCES, "the quick", "a prompt goes in and the server answers every request"]
CONFIG = "generative:\n  max_running_sequences: 4\n  max_waiting_sequences: 8\n"


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, tiny_genai_built: tuple[Path, Path]
) -> Iterator[tuple[ServerProcess, Path]]:
    from tests.genai_models import publish_genai

    root = tmp_path_factory.mktemp("genai")
    publish_genai(tiny_genai_built[1], root / "models", config=CONFIG)
    process = ServerProcess(
        "--model-repository", str(root / "models"), log_path=root / "server.log", grpc=False
    ).start(timeout_s=90)
    yield process, tiny_genai_built[0]
    process.stop()


def hf_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def expected(folder: Path, ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) for greedy `ids`, from transformers."""
    tokens = reference_greedy(folder, ids, max_tokens)
    room = min(max_tokens, CONTEXT - len(ids))
    finish = "length" if len(tokens) == room else "stop"
    text = hf_tokenizer(folder).decode(tokens, skip_special_tokens=True)
    return text, len(tokens), finish


def test_greedy_completions_match_transformers_streamed_and_not(
    served: tuple[ServerProcess, Path],
) -> None:
    from openai import OpenAI

    server, folder = served
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    tokenizer = hf_tokenizer(folder)
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        assert ids[0] == tokenizer.bos_token_id
        text, count, finish = expected(folder, ids, 30)
        answer = client.completions.create(
            model="llama", prompt=prompt, max_tokens=30, temperature=0
        )
        assert answer.choices[0].text == text, prompt
        assert answer.choices[0].finish_reason == finish
        assert answer.usage is not None
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), count)
        streamed = client.completions.create(
            model="llama", prompt=prompt, max_tokens=30, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text, prompt


def test_concurrent_streams_are_each_correct(served: tuple[ServerProcess, Path]) -> None:
    from openai import AsyncOpenAI

    server, folder = served
    tokenizer = hf_tokenizer(folder)
    cases = [(p, 20 + 5 * (i % 4)) for i, p in enumerate(PROMPTS * 2)]  # 16: past the batch of 4

    async def one(client: AsyncOpenAI, prompt: str, max_tokens: int) -> str:
        stream = await client.completions.create(
            model="llama", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in cases))

    texts = asyncio.run(run())
    for (prompt, max_tokens), text in zip(cases, texts, strict=True):
        assert text == expected(folder, tokenizer(prompt).input_ids, max_tokens)[0], prompt


def test_chat_uses_the_template_from_chat_template_jinja(
    served: tuple[ServerProcess, Path],
) -> None:
    from openai import OpenAI

    server, folder = served
    tokenizer = hf_tokenizer(folder)
    messages = [{"role": "user", "content": "a prompt goes in"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # As apply_chat_template(tokenize=True) encodes it: the template wrote the special tokens.
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.bos_token_id  # the template writes it, once
    text, _count, _ = expected(folder, ids, 15)
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="llama",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=15,
        temperature=0,
    )
    assert answer.choices[0].message.content == text
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(ids)


def test_no_max_tokens_generates_to_the_end_of_the_context(
    served: tuple[ServerProcess, Path],
) -> None:
    server, folder = served
    prompt = PROMPTS[0]
    ids = hf_tokenizer(folder)(prompt).input_ids
    body = {"model": "llama", "prompt": prompt, "temperature": 0}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    text, count, finish = expected(folder, ids, CONTEXT)
    assert (reply["usage"]["completion_tokens"], reply["choices"][0]["finish_reason"]) == (
        count,
        finish,
    )
    assert reply["choices"][0]["text"] == text
    assert count > 16  # the old default stopped at 16


def test_a_prompt_past_the_context_is_a_400_naming_it(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    body = {"model": "llama", "prompt": [5] * (CONTEXT + 2), "max_tokens": 3}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert f"maximum context length is {CONTEXT} tokens" in message
    assert f"resulted in {CONTEXT + 2} tokens" in message


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="llama",version="1"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_a_client_that_leaves_frees_its_place(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    body = {"model": "llama", "prompt": "the", "max_tokens": 120, "temperature": 0,
            "stop": "\u0000never", "stream": True}  # fmt: skip
    payload = orjson.dumps(body)
    with socket.create_connection(("127.0.0.1", server.http_port)) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 10
    while metric(server, "sluice_generation_running_sequences") > 0:
        assert time.monotonic() < deadline, "the sequence still runs after its client left"
        time.sleep(0.05)
    assert metric(server, "sluice_generation_kv_cache_used_bytes") == 0
    assert metric(server, "sluice_generation_kv_cache_budget_bytes") > 0


def test_latencies_are_exported_as_histograms(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    body = {"model": "llama", "prompt": "the quick", "max_tokens": 5, "temperature": 0}
    before = metric(server, "sluice_generation_e2e_seconds_count")
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    assert reply["usage"]["completion_tokens"] == 5
    assert metric(server, "sluice_generation_e2e_seconds_count") == before + 1
    assert metric(server, "sluice_generation_ttft_seconds_count") >= 1
    assert metric(server, "sluice_generation_itl_seconds_count") >= 4


def test_generation_under_two_workers_is_greedy_identical(
    tmp_path: Path, tiny_genai_built: tuple[Path, Path]
) -> None:
    """The workers relay /v1 to the engine process, which runs the Engine: the same tokens,
    one request per connection (they land on both workers)."""
    from tests.genai_models import publish_genai

    publish_genai(tiny_genai_built[1], tmp_path / "models", config=CONFIG)
    server = ServerProcess(
        "--model-repository", str(tmp_path / "models"), "--workers", "2",
        log_path=tmp_path / "server.log", grpc=False,
    ).start(timeout_s=90)  # fmt: skip
    try:
        folder = tiny_genai_built[0]
        tokenizer = hf_tokenizer(folder)
        for prompt in PROMPTS[:4]:
            body = {"model": "llama", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            text = expected(folder, tokenizer(prompt).input_ids, 12)[0]
            assert reply.json()["choices"][0]["text"] == text, prompt
    finally:
        server.stop()
