"""Triton's generate extension and token-counted admission end to end, on a real `sluice serve`
with the tiny GPT-2: `/v2/models/{m}/generate` and `/generate_stream` answer what transformers
`generate` gives, errors are the v2 `{"error"}` body, and `rate_limit.unit: tokens` charges
prompt plus completion tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.generative import (
    check_unused_tokens_are_refunded,
    copy_tiny,
    reference_greedy,
    token_quota_settings,
)
from tests.integration.helpers_e2e import Key, write_settings
from tests.servers import ServerProcess


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_built: tuple[Path, Path]
) -> tuple[Path, Path]:
    return copy_tiny(tiny_gpt2_built, tmp_path_factory.mktemp("generate"))


def serve(
    repository: Path, folder: Path, settings: dict[str, Any] | None = None, grpc: bool = False
) -> ServerProcess:
    args = ["--model-repository", str(repository)]
    if settings is not None:
        args += ["--config", str(write_settings(folder / "server.yaml", settings))]
    process = ServerProcess(*args, log_path=folder / "server.log", grpc=grpc)
    return process.start(timeout_s=90)


@pytest.fixture(scope="module")
def server(
    repository: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    process = serve(repository[1], tmp_path_factory.mktemp("generate-server"), grpc=True)
    yield process
    process.stop()


def expected_text(folder: Path, text: str, max_tokens: int) -> tuple[str, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = reference_greedy(folder, tokenizer.encode(text).ids, max_tokens)
    if 0 in tokens:
        tokens = tokens[: tokens.index(0)]
    return tokenizer.decode(tokens), len(tokens)


def test_generate_matches_transformers(
    server: ServerProcess, repository: tuple[Path, Path]
) -> None:
    body = {"text_input": "the lazy dog", "parameters": {"max_tokens": 18, "temperature": 0}}
    reply = httpx.post(f"{server.url}/v2/models/tiny/generate", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    text, count = expected_text(repository[0], "the lazy dog", 18)
    assert answer["text_output"] == text
    assert answer["usage"]["completion_tokens"] == count
    assert answer["model_name"] == "tiny"


def test_generate_stream_sends_the_same_text_in_events(
    server: ServerProcess, repository: tuple[Path, Path]
) -> None:
    body = {"text_input": "one batch", "max_tokens": 22, "temperature": 0}
    reply = httpx.post(f"{server.url}/v2/models/tiny/generate_stream", json=body, timeout=30)
    assert reply.status_code == 200
    events = [orjson.loads(part[6:]) for part in reply.text.split("\n\n") if part]
    text, count = expected_text(repository[0], "one batch", 22)
    assert "".join(e["text_output"] for e in events) == text
    assert events[-1]["finish_reason"] in ("stop", "length")
    assert events[-1]["usage"]["completion_tokens"] == count


@pytest.mark.parametrize(
    "body",
    [
        # TensorRT-LLM's ensemble, its inputs as tensors of one element (it was a 400).
        {"text_input": ["the lazy dog"], "max_tokens": [18], "temperature": [0.0],
         "bad_words": [""], "stop_words": [""], "end_id": [0], "pad_id": [0],
         "beam_width": [1], "stream": [False], "exclude_input_in_output": [True]},
        # vLLM's backend: sampling_parameters as a JSON string.
        {"text_input": "the lazy dog", "stream": False, "exclude_input_in_output": True,
         "sampling_parameters": '{"max_tokens": 18, "temperature": 0}'},
    ],
)  # fmt: skip
def test_llm_backend_clients_requests_are_served(
    server: ServerProcess, repository: tuple[Path, Path], body: dict[str, Any]
) -> None:
    text, count = expected_text(repository[0], "the lazy dog", 18)
    for route in ("generate", "generate_stream"):
        reply = httpx.post(f"{server.url}/v2/models/tiny/{route}", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        if route == "generate_stream":
            events = [orjson.loads(part[6:]) for part in reply.text.split("\n\n") if part]
        else:
            events = [reply.json()]
        assert "".join(e["text_output"] for e in events) == text
        assert events[-1]["usage"]["completion_tokens"] == count


def test_max_tokens_past_the_context_is_clamped_as_triton_backends_clamp_it(
    server: ServerProcess, repository: tuple[Path, Path]
) -> None:
    # Where the OpenAI routes refuse it (a 400): TensorRT-LLM's backend lowers the requested
    # output tokens to what the sequence length leaves, so this extension does too.
    text_input = "the lazy dog " * 12
    body = {"text_input": text_input, "max_tokens": 500, "temperature": 0}
    reply = httpx.post(f"{server.url}/v2/models/tiny/generate", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    text, count = expected_text(repository[0], text_input, 500)  # clamped to the context too
    assert (answer["text_output"], answer["usage"]["completion_tokens"]) == (text, count)
    assert answer["usage"]["prompt_tokens"] + count <= 64 < answer["usage"]["prompt_tokens"] + 500


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("tiny/generate", {"text_input": "a " * 80, "max_tokens": 2}, 400,
         "This model's maximum context length is 64 tokens. However, your prompt resulted in"),
        ("nope/generate", {"text_input": "a"}, 404, "unknown model 'nope'"),
        ("tiny/generate", {"text_input": "a", "parameters": {"top_k": -3}}, 400, "top_k"),
        ("tiny/generate_stream", {"text_input": 5}, 400, "text_input must be a string"),
        ("tiny/generate", {"text_input": "a", "parameters": {"beams": 2}}, 400,
         "unknown generate parameter 'beams'"),
        ("tiny/generate", {"text_input": "a", "max_new_tokens": 3}, 400,
         "unknown generate field 'max_new_tokens'"),
    ],
)  # fmt: skip
def test_bad_input_is_a_v2_error(
    server: ServerProcess, path: str, body: dict[str, Any], status: int, message: str
) -> None:
    reply = httpx.post(f"{server.url}/v2/models/{path}", json=body, timeout=10)
    assert reply.status_code == status
    assert set(reply.json()) == {"error"}
    assert message in reply.json()["error"]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_a_null_sampling_key_takes_its_default(server: ServerProcess, route: str) -> None:
    url = f"{server.url}/v2/models/tiny/{route}"
    plain = httpx.post(url, json={"text_input": "one batch", "temperature": 0}, timeout=30)
    nulls = {"text_input": "one batch", "temperature": 0, "top_p": None,
             "parameters": {"max_tokens": None, "seed": None}}  # fmt: skip
    given = httpx.post(url, json=nulls, timeout=30)
    assert plain.status_code == given.status_code == 200, given.text
    assert given.text == plain.text


def test_rate_limit_in_tokens_charges_prompt_and_completion(
    repository: tuple[Path, Path], tmp_path: Path
) -> None:
    limits = {"rate_limit": {"unit": "tokens", "default": {"rate_per_s": 0.01, "burst": 50}}}
    process = serve(repository[1], tmp_path, limits)
    try:
        url = f"{process.url}/v1/completions"
        ten = list(range(1, 11))
        first = httpx.post(url, json={"model": "tiny", "prompt": ten, "max_tokens": 30})
        assert first.status_code == 200, first.text  # 40 of the 50 tokens
        second = httpx.post(url, json={"model": "tiny", "prompt": ten, "max_tokens": 30})
        assert second.status_code == 429
        assert "Retry-After" in second.headers
        error = second.json()["error"]
        # OpenAI types a 429 by what ran out (a token limit's is "tokens"; it was
        # "rate_limit_error", which OpenAI never sends).
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        huge = httpx.post(url, json={"model": "tiny", "prompt": ten, "max_tokens": 50})
        assert huge.status_code == 400
        assert "request of 60 tokens exceeds" in huge.json()["error"]["message"]
    finally:
        process.stop()


def test_tokens_a_generation_did_not_use_are_refunded(
    repository: tuple[Path, Path], tmp_path: Path
) -> None:
    process = serve(repository[1], tmp_path, token_quota_settings())
    try:
        check_unused_tokens_are_refunded(process.url, repository[0])
    finally:
        process.stop()


def test_grpc_stream_is_decoupled_one_response_per_token_batch(
    server: ServerProcess, repository: tuple[Path, Path]
) -> None:
    # sluice's own stubs: tritonclient's generated modules cannot share a process with them.
    import grpc

    from server.grpc.proto import grpc_service_pb2 as pb
    from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc

    def request(rid: str, text: bytes, **params: Any) -> Any:
        message = pb.ModelInferRequest(model_name="tiny", id=rid)
        message.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        message.inputs[0].contents.bytes_contents.append(text)
        for key, value in params.items():
            if isinstance(value, float):
                message.parameters[key].double_param = value
            else:
                message.parameters[key].int64_param = value
        return message

    requests = [request("g1", b"the quick brown", max_tokens=20, temperature=0.0),
                request("g2", b"a", top_p=7.0)]  # fmt: skip
    with grpc.insecure_channel(server.grpc_url) as channel:
        answers = list(pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests)))
    errors = [a.error_message for a in answers if a.error_message]
    responses = [a.infer_response for a in answers if not a.error_message]
    assert {r.id for r in responses} == {"g1"}
    parts = [r.raw_output_contents[0][4:].decode() for r in responses]  # 4-byte length prefix
    finals = [r for r in responses if r.parameters["triton_final_response"].bool_param]
    assert len(finals) == 1
    assert finals[0] is responses[-1]
    text, count = expected_text(repository[0], "the quick brown", 20)
    assert "".join(parts) == text
    assert len(parts) > 1  # one response per token batch, not one at the end
    assert finals[0].parameters["completion_tokens"].int64_param == count
    assert finals[0].parameters["finish_reason"].string_param in ("stop", "length")
    assert any("top_p must be from 0 to 1; got 7.0" in e for e in errors)


def test_grpc_stream_takes_what_tritonclient_sends(
    server: ServerProcess, repository: tuple[Path, Path]
) -> None:
    """tritonclient's `async_stream_infer(..., enable_empty_final_response=True, priority=1)`
    sets these two parameters (as bool_param and uint64_param): both were refused as unknown
    generation parameters. With the first, the final flag comes on an empty last response, as
    Triton sends it. An input beside text_input is refused (it was ignored)."""
    import grpc

    from server.grpc.proto import grpc_service_pb2 as pb
    from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc

    message = pb.ModelInferRequest(model_name="tiny", id="t1")
    message.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    message.inputs[0].contents.bytes_contents.append(b"the quick brown")
    message.parameters["max_tokens"].int64_param = 20
    message.parameters["temperature"].double_param = 0.0
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    message.parameters["priority"].uint64_param = 1
    extra = pb.ModelInferRequest()
    extra.CopyFrom(message)
    extra.id = "t2"
    extra.inputs.add(name="bogus", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"x")
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answers = list(stub.ModelStreamInfer(iter([message])))
        refused = list(stub.ModelStreamInfer(iter([extra])))
    assert [a.error_message for a in answers if a.error_message] == []
    responses = [a.infer_response for a in answers]
    *texts, last = responses
    assert last.parameters["triton_final_response"].bool_param
    assert len(last.outputs) == 0
    assert len(last.raw_output_contents) == 0
    assert not any(r.parameters["triton_final_response"].bool_param for r in texts)
    text, count = expected_text(repository[0], "the quick brown", 20)
    assert "".join(r.raw_output_contents[0][4:].decode() for r in texts) == text
    assert last.parameters["completion_tokens"].int64_param == count
    assert [a.error_message for a in refused] == [
        "a generative model takes one input 'text_input' BYTES [1]; "
        "got text_input BYTES [1], bogus BYTES [1]"
    ]


def test_api_keys_guard_every_generation_route(
    repository: tuple[Path, Path], tmp_path: Path
) -> None:
    from openai import AuthenticationError, OpenAI, PermissionDeniedError

    allowed, other = Key.create("acme"), Key.create("globex", models=["something-else"])
    process = serve(repository[1], tmp_path, {"auth": {"keys": [allowed.entry(), other.entry()]}})
    try:
        client = OpenAI(base_url=f"{process.url}/v1", api_key=allowed.key)
        answer = client.completions.create(model="tiny", prompt="a", max_tokens=3, temperature=0)
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == 1
        assert [m.id for m in client.models.list()] == ["tiny"]
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{process.url}/v1", api_key="sk-wrong").models.list()
        outsider = OpenAI(base_url=f"{process.url}/v1", api_key=other.key)
        assert [m.id for m in outsider.models.list()] == []
        with pytest.raises(PermissionDeniedError):
            outsider.completions.create(model="tiny", prompt="a", max_tokens=3)
        reply = httpx.post(
            f"{process.url}/v2/models/tiny/generate", json={"text_input": "a"}, timeout=10
        )
        assert reply.status_code == 401
        assert set(reply.json()) == {"error"}
    finally:
        process.stop()


def test_chat_content_given_as_text_parts_is_joined(server: ServerProcess) -> None:
    def ask(content: object) -> str:
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": content}]}  # fmt: skip
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["message"]["content"])

    parts = [{"type": "text", "text": "one "}, {"type": "text", "text": "batch"}]
    assert ask(parts) == ask("one batch")
    bad = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        timeout=10,
    )
    assert bad.status_code == 400
    assert "messages[0].content" in bad.json()["error"]["message"]
