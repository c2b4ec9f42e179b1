"""A text pipeline (tokenizer -> ONNX embedding-sum -> Python normalization) served by a real
`sluice serve`, from every client: KServe v2 JSON BYTES, the binary extension's BYTES layout,
gRPC `bytes_contents`, and tritonclient (http here; grpc in a child process, see
test_tritonclient.py for why). Answers are compared with the same computation done in-process.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from tests.servers import ServerProcess
from tests.text_models import DIM, expected_embeddings, write_text_repository

MAX_LENGTH = 8
TEXTS = ["the quick brown fox", "text goes in and answers come out", "grüße, dog"]
LONG = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = f"backend: tokenizer\ntokenizer: {{max_length: {MAX_LENGTH}}}\n"
    return write_text_repository(tmp_path_factory.mktemp("repository"), config)


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--model-repository", str(repo), "--allow-python-models"]
    process = ServerProcess(*args, log_path=log).start(timeout_s=90)
    yield process
    process.stop()


def expected(repo: Path, texts: list[str]) -> np.ndarray:
    return expected_embeddings(repo, texts, MAX_LENGTH)


def token_counts(repo: Path, texts: list[str]) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(repo / "tok" / "1" / "tokenizer.json"))
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(texts)]


def embeddings(body: dict[str, Any]) -> np.ndarray:
    (output,) = body["outputs"]
    assert (output["name"], output["datatype"]) == ("EMBEDDING", "FP32")
    return np.array(output["data"], np.float32).reshape(output["shape"])


def test_json_bytes(server: ServerProcess, repo: Path) -> None:
    tensor = {"name": "TEXT", "datatype": "BYTES", "shape": [len(TEXTS)], "data": TEXTS}
    response = httpx.post(f"{server.url}/v2/models/embedder/infer", json={"inputs": [tensor]})
    assert response.status_code == 200, response.text
    got = embeddings(response.json())
    assert got.shape == (len(TEXTS), DIM)
    np.testing.assert_allclose(got, expected(repo, TEXTS), rtol=1e-5, atol=1e-6)
    counts = token_counts(repo, TEXTS)
    cut = sum(length > MAX_LENGTH for length in counts)
    tokens = sum(min(length, MAX_LENGTH) for length in counts)
    assert response.json()["parameters"] == ({"truncated_rows": cut} if cut else {}) | {
        "tokens": tokens
    }


def test_binary_bytes_layout(server: ServerProcess, repo: Path) -> None:
    raw = [text.encode() for text in TEXTS]
    data = b"".join(struct.pack("<I", len(item)) + item for item in raw)
    header = {
        "inputs": [
            {"name": "TEXT", "datatype": "BYTES", "shape": [len(raw)],
             "parameters": {"binary_data_size": len(data)}}
        ]
    }  # fmt: skip
    head = json.dumps(header).encode()
    response = httpx.post(
        f"{server.url}/v2/models/embedder/infer",
        content=head + data,
        headers={
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(
        embeddings(response.json()), expected(repo, TEXTS), rtol=1e-5, atol=1e-6
    )


def grpc_infer(server: ServerProcess, texts: list[bytes]) -> Any:
    # Imported here: the tritonclient.grpc child process runs this file and cannot load both.
    from server.grpc.proto import grpc_service_pb2 as pb
    from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name="embedder", id="g")
    tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[len(texts)])
    tensor.contents.bytes_contents.extend(texts)
    with grpc.insecure_channel(server.grpc_url) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)


def test_grpc_bytes_contents(server: ServerProcess, repo: Path) -> None:
    answer = grpc_infer(server, [text.encode() for text in TEXTS])
    (output,) = answer.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("EMBEDDING", "FP32", [3, DIM])
    got = np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(3, DIM)
    np.testing.assert_allclose(got, expected(repo, TEXTS), rtol=1e-5, atol=1e-6)


def test_truncated_rows_are_reported_and_the_cut_text_embedded(
    server: ServerProcess, repo: Path
) -> None:
    rows = ["dog", LONG]
    assert token_counts(repo, rows)[0] <= MAX_LENGTH < token_counts(repo, rows)[1]
    tensor = {"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": rows}
    response = httpx.post(f"{server.url}/v2/models/embedder/infer", json={"inputs": [tensor]})
    assert response.status_code == 200, response.text
    tokens = token_counts(repo, rows)[0] + MAX_LENGTH
    assert response.json()["parameters"] == {"truncated_rows": 1, "tokens": tokens}
    np.testing.assert_allclose(
        embeddings(response.json()), expected(repo, rows), rtol=1e-5, atol=1e-6
    )
    answer = grpc_infer(server, [row.encode() for row in rows])
    assert answer.parameters["truncated_rows"].int64_param == 1


def test_text_that_is_not_utf8_is_400_naming_step_input_and_row(server: ServerProcess) -> None:
    raw = [b"dog", b"caf\xe9"]
    data = b"".join(struct.pack("<I", len(item)) + item for item in raw)
    head = json.dumps(
        {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2],
                     "parameters": {"binary_data_size": len(data)}}]}
    ).encode()  # fmt: skip
    response = httpx.post(
        f"{server.url}/v2/models/embedder/infer",
        content=head + data,
        headers={"Inference-Header-Content-Length": str(len(head))},
    )
    message = (
        "pipeline 'embedder' step 1 ('tok'): input 'text' row 1 is not valid UTF-8 (unexpected "
        "end of data at byte 3)"
    )
    assert (response.status_code, response.json()) == (400, {"error": message})
    with pytest.raises(grpc.RpcError) as caught:
        grpc_infer(server, raw)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == message


def test_metadata_config_and_per_step_statistics(server: ServerProcess) -> None:
    metadata = httpx.get(f"{server.url}/v2/models/embedder").json()
    assert metadata["platform"] == "ensemble"
    assert metadata["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["outputs"] == [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, DIM]}]
    config = httpx.get(f"{server.url}/v2/models/embedder/config").json()
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == [
        "tok",
        "embed",
        "norm",
    ]
    before = {
        s["name"]: s["inference_stats"]["success"]["count"]
        for s in httpx.get(f"{server.url}/v2/models/stats").json()["model_stats"]
    }
    tensor = {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["dog"]}
    ok = httpx.post(f"{server.url}/v2/models/embedder/infer", json={"inputs": [tensor]})
    assert ok.status_code == 200, ok.text
    after = {
        s["name"]: s["inference_stats"]["success"]["count"]
        for s in httpx.get(f"{server.url}/v2/models/stats").json()["model_stats"]
    }
    assert {name: after[name] - before[name] for name in after} == {
        "embedder": 1,
        "tok": 1,
        "embed": 1,
        "norm": 1,
    }


def test_tritonclient_http(server: ServerProcess, repo: Path) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    for binary in (False, True):
        tensor = httpclient.InferInput("TEXT", [len(TEXTS)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], object), binary)
        result = client.infer("embedder", [tensor])
        np.testing.assert_allclose(
            result.as_numpy("EMBEDDING"), expected(repo, TEXTS), rtol=1e-5, atol=1e-6
        )
    assert client.get_model_metadata("embedder")["platform"] == "ensemble"
    client.close()


def tritonclient_grpc(url: str) -> dict[str, Any]:
    """The tritonclient.grpc calls; runs in a child process (it clashes with sluice's protos)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("TEXT", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], object))
    result = client.infer("embedder", [tensor])
    metadata = client.get_model_metadata("embedder", as_json=True)
    return {"embedding": result.as_numpy("EMBEDDING").tolist(), "platform": metadata["platform"]}


def test_tritonclient_grpc(server: ServerProcess, repo: Path) -> None:
    child = subprocess.run(
        [sys.executable, __file__, server.grpc_url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    assert out["platform"] == "ensemble"
    np.testing.assert_allclose(
        np.array(out["embedding"], np.float32), expected(repo, TEXTS), rtol=1e-5, atol=1e-6
    )


if __name__ == "__main__":
    print(json.dumps(tritonclient_grpc(sys.argv[1])))
