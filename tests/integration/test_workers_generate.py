"""Generation under `sluice serve --workers 2`: the /v1 routes, Triton's generate extension and
gRPC ModelStreamInfer are served by the workers and relayed to the engine process, which owns the
scheduler, the key/value cache and the limiter (server/link/remote.py, server/link/host.py,
engine/generation/service.py). What must hold is what one process guarantees: greedy answers are
token-identical to transformers (as the in-process tests assert), streams come chunk by chunk,
a client that leaves, or a worker that dies, frees its slot, errors keep their bodies, the
engine dying ends a stream with an error, SIGTERM drains streams, and token limits are exact.

Two models in one repository: `tiny` (64-token context) for answers, `long` (1,024 tokens, no
end-of-text stop, one running sequence and one waiting) for generations that run long enough
to leave or kill mid-way, and to be refused while the scheduler is full."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.generative import (
    CHAT_TEMPLATE,
    SENTENCES,
    check_unused_tokens_are_refunded,
    copy_tiny,
    publish_tiny,
    reference_greedy,
    tiny_gpt2,
    token_quota_settings,
)
from tests.integration.helpers_e2e import write_settings
from tests.integration.test_workers import engine_process, owner, wait_for, workers
from tests.servers import ServerProcess


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_built: tuple[Path, Path]
) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("workers-generate")
    copy_tiny(tiny_gpt2_built, root)
    tiny_gpt2(root / "hf-long", n_positions=1024)
    version = publish_tiny(root / "hf-long", root / "models", name="long")
    config = version.parent / "config.yaml"
    long_only = "eos_token_ids: []\n  max_running_sequences: 1\n  max_waiting_sequences: 1"
    config.write_text(config.read_text().replace("eos_token_ids:\n  - 0", long_only))
    return root / "hf", root / "models"


def serve(repository: Path, folder: Path, settings: dict[str, Any] | None = None) -> ServerProcess:
    args = ["--workers", "2", "--drain-timeout-s", "10", "--model-repository", str(repository)]
    if settings is not None:
        args += ["--config", str(write_settings(folder / "server.yaml", settings))]
    process = ServerProcess(*args, log_path=folder / f"server-{time.monotonic_ns()}.log")
    return process.start(timeout_s=90)


@pytest.fixture(scope="module")
def server(
    repository: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    process = serve(repository[1], tmp_path_factory.mktemp("workers-generate-server"))
    yield process
    process.stop()


def tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def expected(folder: Path, ids: list[int], max_tokens: int) -> tuple[str, int]:
    """(text, completion tokens) of greedy `ids`: what the in-process server answers."""
    tokens = reference_greedy(folder, ids, max_tokens)
    if 0 in tokens:  # the end-of-text token ends it and is not counted
        tokens = tokens[: tokens.index(0)]
    return tokenizer(folder).decode(tokens), len(tokens)


def events(body: str) -> list[Any]:
    lines = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", body
    return [orjson.loads(line) for line in lines[:-1]]


def metric(server: ServerProcess, name: str, model: str = "long") -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{model}",version="1"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def settled(server: ServerProcess) -> bool:
    """No sequence of `long` runs and its cache holds nothing (the slot was freed)."""
    running = metric(server, "sluice_generation_running_sequences")
    return running == 0 and metric(server, "sluice_generation_kv_cache_used_bytes") == 0


async def fresh_posts(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """One request per new connection, all at once (connections land on both workers)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        return await asyncio.gather(*(client.post(url, json=body) for body in bodies))


# -- answers -------------------------------------------------------------------------------------


def test_completions_stream_and_not_are_token_identical(
    server: ServerProcess, repository: tuple[Path, Path]
) -> None:
    folder = repository[0]
    cases = []
    for i in range(8):
        ids = tokenizer(folder).encode(" ".join(SENTENCES[: i % 4 + 1])).ids[: 4 + i * 2]
        cases.append((ids, 6 + (i * 5) % 30, i % 2 == 1))
    usage = {"stream_options": {"include_usage": True}}
    bodies = [{"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "stream": s}
              | (usage if s else {}) for ids, n, s in cases]  # fmt: skip
    replies = asyncio.run(fresh_posts(f"{server.url}/v1/completions", bodies))
    for (ids, max_tokens, stream), reply in zip(cases, replies, strict=True):
        assert reply.status_code == 200, reply.text
        text, count = expected(folder, ids, max_tokens)
        if stream:
            assert reply.headers["content-type"].startswith("text/event-stream")
            *chunks, last = events(reply.text)
            assert "".join(c["choices"][0]["text"] for c in chunks) == text
            assert last["usage"]["completion_tokens"] == count
        else:
            body = reply.json()
            assert body["choices"][0]["text"] == text
            assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": count,
                                     "total_tokens": len(ids) + count}  # fmt: skip


def test_chat_completion_and_models_through_a_worker(
    server: ServerProcess, repository: tuple[Path, Path]
) -> None:
    import jinja2
    from openai import OpenAI

    folder = repository[0]
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert sorted(m.id for m in client.models.list()) == ["long", "tiny"]
    messages = [{"role": "user", "content": "a prompt goes in"}]
    prompt = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)
    ids = tokenizer(folder).encode(prompt.render(messages=messages, add_generation_prompt=True)).ids
    text, count = expected(folder, ids, 15)
    answer = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=15, temperature=0,  # type: ignore[arg-type]
    )  # fmt: skip
    assert answer.choices[0].message.content == text
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), count)
    streamed = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=15, temperature=0, stream=True,  # type: ignore[arg-type]
    )  # fmt: skip
    parts = [chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices]
    assert "".join(parts) == text


def test_generate_and_generate_stream_are_token_identical(
    server: ServerProcess, repository: tuple[Path, Path]
) -> None:
    folder = repository[0]
    text, count = expected(folder, tokenizer(folder).encode("the lazy dog").ids, 18)
    body = {"text_input": "the lazy dog", "parameters": {"max_tokens": 18, "temperature": 0}}
    whole, streamed = asyncio.run(
        fresh_posts(f"{server.url}/v2/models/tiny/generate", [body])
    ) + asyncio.run(fresh_posts(f"{server.url}/v2/models/tiny/generate_stream", [body]))
    assert whole.status_code == 200, whole.text
    assert whole.json()["text_output"] == text
    assert whole.json()["usage"]["completion_tokens"] == count
    lines = [orjson.loads(x[6:]) for x in streamed.text.split("\n\n") if x.startswith("data: ")]
    assert "".join(event["text_output"] for event in lines) == text
    assert lines[-1]["usage"]["completion_tokens"] == count
    assert all("finish_reason" not in event for event in lines[:-1])


def test_grpc_stream_infer_is_token_identical(
    server: ServerProcess, repository: tuple[Path, Path]
) -> None:
    import grpc

    from server.grpc.proto import grpc_service_pb2 as pb
    from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc

    message = pb.ModelInferRequest(model_name="tiny", id="g1")
    message.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    message.inputs[0].contents.bytes_contents.append(b"the quick brown")
    message.parameters["max_tokens"].int64_param = 20
    message.parameters["temperature"].double_param = 0.0
    with grpc.insecure_channel(server.grpc_url) as channel:
        answers = list(pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([message])))
    assert not any(a.error_message for a in answers), answers
    parts = [a.infer_response.raw_output_contents[0][4:].decode() for a in answers]
    folder = repository[0]
    text, count = expected(folder, tokenizer(folder).encode("the quick brown").ids, 20)
    assert "".join(parts) == text
    assert len(parts) > 1  # one response per token batch, not one at the end
    final = answers[-1].infer_response.parameters
    assert final["triton_final_response"].bool_param
    assert final["completion_tokens"].int64_param == count


@pytest.mark.parametrize(
    ("path", "body", "status", "message", "param", "code"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": [5] * 70, "max_tokens": 3}, 400,
         "This model's maximum context length is 64 tokens. However, your prompt resulted in 70 "
         "tokens", None, None),
        # The engine process refuses it: OpenAI's code comes back with it.
        ("/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": "the lazy dog " * 30}]},
         400, "This model's maximum context length is 64 tokens", "messages",
         "context_length_exceeded"),
        # The route's refusal of a max_tokens past the context reaches the engine process (it
        # was clamped there: a 200).
        ("/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 63},
         400, "in the messages, 63 in the completion)", "messages", "context_length_exceeded"),
        ("/v1/completions", {"model": "nope", "prompt": "a"}, 404, "unknown model 'nope'", None,
         "model_not_found"),
        # Checked in the engine process: the field it names comes back with the message.
        ("/v1/completions", {"model": "tiny", "prompt": "a", "top_p": 2}, 400,
         "top_p must be from 0 to 1", "top_p", None),
        ("/v2/models/tiny/generate", {"text_input": "a", "temperature": 5}, 400,
         "temperature must be from 0 to 2; got 5", None, None),
        ("/v2/models/nope/generate_stream", {"text_input": "a"}, 404, "unknown model 'nope'",
         None, None),
    ],
)  # fmt: skip
def test_errors_keep_their_bodies(
    server: ServerProcess,
    path: str,
    body: dict[str, Any],
    status: int,
    message: str,
    param: str | None,
    code: str | None,
) -> None:
    reply = httpx.post(f"{server.url}{path}", json=body, timeout=10)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    if path.startswith("/v1"):
        assert set(error) == {"message", "type", "param", "code"}
        assert message in error["message"]
        assert (error["param"], error["code"]) == (param, code)
    else:
        assert set(reply.json()) == {"error"}
        assert message in error


# -- streams that end early ----------------------------------------------------------------------


def open_stream(server: ServerProcess, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw HTTP request for a long generation, left open (close it to leave)."""
    payload = orjson.dumps(body)
    client = socket.create_connection(("127.0.0.1", server.http_port))
    client.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return client


def read_until(client: socket.socket, marker: bytes, received: bytes = b"") -> bytes:
    """What the server sent up to and including `marker` (the socket's timeout bounds each read;
    a connection closed first fails)."""
    while marker not in received:
        data = client.recv(65536)
        assert data, f"closed before {marker!r}: {received[-300:]!r}"
        received += data
    return received


LONG = {"model": "long", "prompt": [3], "max_tokens": 1000, "temperature": 0}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {**LONG, "stream": True}),
        ("/v1/completions", LONG),
        ("/v2/models/long/generate_stream", {"text_input": "a", "max_tokens": 1000}),
    ],
)
def test_a_client_that_leaves_frees_its_slot(
    server: ServerProcess, path: str, body: dict[str, Any]
) -> None:
    before = metric(server, "sluice_generation_tokens_total")
    with open_stream(server, path, body) as client:
        if body.get("stream", path.endswith("_stream")):
            # Chunk by chunk: an event arrives while the sequence is still running.
            client.settimeout(20)
            read_until(client, b"data: ")
            assert metric(server, "sluice_generation_running_sequences") == 1
        else:
            wait_for(lambda: metric(server, "sluice_generation_running_sequences") == 1, "start")
    wait_for(lambda: settled(server), "the slot freed after the client left")
    assert metric(server, "sluice_generation_tokens_total") - before < 999


def test_a_full_scheduler_is_a_503_with_the_openai_error_object(server: ServerProcess) -> None:
    with (
        open_stream(server, "/v1/completions", {**LONG, "stream": True}) as client,
        open_stream(server, "/v1/completions", {**LONG, "stream": True}) as waiting,
    ):
        client.settimeout(20)
        waiting.settimeout(20)
        # One runs, one waits: the scheduler has no room for a third.
        wait_for(lambda: metric(server, "sluice_generation_waiting_sequences") == 1, "a wait")
        refused = [
            httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 5}, timeout=10),
            httpx.post(
                f"{server.url}/v2/models/long/generate", json={"text_input": "a"}, timeout=10
            ),
        ]
    for reply in refused:
        assert reply.status_code == 503, reply.text
        assert "Retry-After" in reply.headers
    message = "has 1 sequences waiting for cache room (max_waiting_sequences 1)"
    assert message in refused[0].json()["error"]["message"]
    assert refused[0].json()["error"]["type"] == "server_error"
    assert message in refused[1].json()["error"]
    wait_for(lambda: settled(server), "the slot freed after the client left")


def test_a_worker_that_dies_has_its_sequences_cancelled(server: ServerProcess) -> None:
    with open_stream(server, "/v1/completions", {**LONG, "stream": True}) as client:
        client.settimeout(20)
        read_until(client, b"data: ")
        holder = owner({client.getsockname()[1]}, workers(server))
        assert holder is not None
        holder.send_signal(signal.SIGKILL)
        wait_for(lambda: settled(server), "the dead worker's sequence cancelled")
    wait_for(lambda: len(workers(server)) == 2, "the worker restarted")


def test_the_engine_dying_ends_the_stream_with_an_error(
    repository: tuple[Path, Path], tmp_path: Path
) -> None:
    process = serve(repository[1], tmp_path)
    try:
        with open_stream(process, "/v1/completions", {**LONG, "stream": True}) as client:
            client.settimeout(20)
            received = read_until(client, b"data: ")
            engine_process(process).send_signal(signal.SIGKILL)
            # It ends with an error event, never a hang (each read bounded by the timeout).
            received = read_until(client, b"data: [DONE]", received)
        errors = [line for line in received.split(b"\n") if b'"error"' in line]
        assert errors, received[-300:]
        assert b"the engine process is gone" in errors[0]
    finally:
        process.stop()


def test_sigterm_drains_a_running_stream(repository: tuple[Path, Path], tmp_path: Path) -> None:
    process = serve(repository[1], tmp_path)
    try:
        body = {**LONG, "max_tokens": 200, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with open_stream(process, "/v1/completions", body) as client:
            client.settimeout(30)
            received = read_until(client, b"data: ")
            assert process.process is not None
            process.process.send_signal(signal.SIGTERM)
            received = read_until(client, b"data: [DONE]", received)
        text = received.split(b"\r\n\r\n", 1)[1].decode()
        usage = [e for e in text.split("\n") if '"completion_tokens"' in e]
        assert usage, text[-300:]
        assert '"completion_tokens":200' in usage[0]
        assert process.wait(30) == 0
    finally:
        process.stop()


# -- limits --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_token_limit_is_exact_across_the_workers(
    repository: tuple[Path, Path], tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    settings = token_quota_settings()
    if backend == "redis":
        redis_url = request.getfixturevalue("redis_url")
        namespace = f"t{time.monotonic_ns()}"
        # A generous timeout: a slow reply on a loaded host must not fall back to local.
        settings["rate_limit"] |= {"backend": "redis", "redis_url": redis_url,
                                   "namespace": namespace, "redis_timeout_s": 2.0}  # fmt: skip
    process = serve(repository[1], tmp_path, settings)
    try:
        check_unused_tokens_are_refunded(process.url, repository[0])
        over = httpx.post(
            f"{process.url}/v1/completions",
            json={"model": "tiny", "prompt": [1] * 40, "max_tokens": 20},
            timeout=10,
        )
        assert over.status_code == 429, over.text
        error = over.json()["error"]
        # OpenAI's type for a used quota, relayed from the engine process with its code.
        assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    finally:
        process.stop()
