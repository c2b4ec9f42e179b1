"""`sluice serve --workers 2` end to end: two worker processes on the same HTTP and gRPC ports in
front of one engine process (server/supervisor.py, server/workers.py, server/link/host.py,
server/link/remote.py). Each client below opens its own connection, so requests spread over both
workers; what must hold is what one process guarantees: answers match the model run in-process,
admission is exact, batches mix the workers' requests, and every view is the whole server's."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import orjson
import psutil
import pytest
import tritonclient.grpc as grpc_client
import tritonclient.http as http_client

from engine.demo import mlp_model
from server.settings import Settings
from tests.models import write_model
from tests.servers import ServerProcess

# Concurrent requests meet in one 50 ms batch window, whichever worker they came through.
MLP_CONFIG = (
    "max_batch_size: 64\ndynamic_batching:\n  max_queue_delay_s: 0.05\n"
    "  dispatch_when_idle: false\n"
)
CLIENTS = 24


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_model(tmp_path / "models", "mlp", mlp_model(), MLP_CONFIG)
    return tmp_path / "models"


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    server = ServerProcess(
        "--workers", "2", "--drain-timeout-s", "5", *args,
        env=env, log_path=tmp_path / f"server-{time.monotonic_ns()}.log",
    )  # fmt: skip
    return server.start()


@pytest.fixture
def server(tmp_path: Path, repo: Path) -> Iterator[ServerProcess]:
    server = serve(tmp_path, "--model-repository", str(repo))
    yield server
    server.stop()


def workers(server: ServerProcess) -> list[psutil.Process]:
    """The supervisor's children that listen on the HTTP port (the engine process does not)."""
    assert server.process is not None
    found = []
    for child in psutil.Process(server.process.pid).children():
        try:
            listening = child.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        if any(c.status == "LISTEN" and c.laddr.port == server.http_port for c in listening):
            found.append(child)
    return found


def engine_process(server: ServerProcess) -> psutil.Process:
    assert server.process is not None
    pids = {w.pid for w in workers(server)}
    (engine,) = [c for c in psutil.Process(server.process.pid).children() if c.pid not in pids]
    return engine


def wait_for(condition: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s} s"
        time.sleep(0.05)  # polling a condition, bounded above


def expected(x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(mlp_model().SerializeToString())
    return session.run(None, {"x": x})[0]  # type: ignore[no-any-return]


def json_body(x: np.ndarray) -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}]}  # fmt: skip


async def fresh_posts(url: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    """One request per new connection, all at once (connections land on both workers)."""
    async with httpx.AsyncClient(
        timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
    ) as client:
        return await asyncio.gather(*(client.post(url, json=body) for body in bodies))


def test_two_workers_listen_on_the_same_ports(server: ServerProcess) -> None:
    assert len(workers(server)) == 2
    x = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)
    http = http_client.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    for binary in (True, False):
        tensor = http_client.InferInput("x", [3, 16], "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        answer = http.infer("mlp", [tensor]).as_numpy("probabilities")
        np.testing.assert_allclose(answer, expected(x), rtol=1e-5)
    grpc = grpc_client.InferenceServerClient(server.grpc_url)
    tensor = grpc_client.InferInput("x", [3, 16], "FP32")
    tensor.set_data_from_numpy(x)
    answer = grpc.infer("mlp", [tensor]).as_numpy("probabilities")
    np.testing.assert_allclose(answer, expected(x), rtol=1e-5)
    assert grpc.is_server_ready()
    assert grpc.get_model_metadata("mlp").inputs[0].shape == [-1, 16]


async def test_requests_of_both_workers_meet_in_one_batcher(server: ServerProcess) -> None:
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(CLIENTS)]
    url = f"{server.url}/v2/models/mlp/infer"
    answers = await fresh_posts(url, [json_body(x) for x in xs])
    for x, answer in zip(xs, answers, strict=True):
        assert answer.status_code == 200, answer.text
        got = np.array(answer.json()["outputs"][0]["data"], np.float32).reshape(1, 10)
        np.testing.assert_allclose(got, expected(x), rtol=1e-5)  # each got its own answer
    async with httpx.AsyncClient(base_url=server.url) as client:
        stats = (await client.get("/v2/models/mlp/stats")).json()["model_stats"][0]
    assert stats["inference_count"] == CLIENTS
    assert stats["execution_count"] < CLIENTS / 2  # batches mixed the workers' requests


async def test_a_rate_limit_admits_its_burst_across_all_workers(tmp_path: Path, repo: Path) -> None:
    env = {"SLUICE_RATE_LIMIT__DEFAULT__RATE_PER_S": "0.001",
           "SLUICE_RATE_LIMIT__DEFAULT__BURST": "5"}  # fmt: skip
    server = serve(tmp_path, "--model-repository", str(repo), env=env)
    try:
        x = np.zeros((1, 16), np.float32)
        answers = await fresh_posts(f"{server.url}/v2/models/mlp/infer", [json_body(x)] * 20)
        codes = sorted(a.status_code for a in answers)
        assert codes == [200] * 5 + [429] * 15  # 5 in all, not 5 per worker
    finally:
        server.stop()


async def test_every_worker_shows_the_whole_server(server: ServerProcess) -> None:
    x = np.zeros((1, 16), np.float32)
    answers = await fresh_posts(f"{server.url}/v2/models/mlp/infer", [json_body(x)] * CLIENTS)
    assert {a.status_code for a in answers} == {200}

    def views() -> list[tuple[float, int, bool, str]]:
        seen = []
        for _ in range(8):  # fresh connections: both workers answer some
            with httpx.Client(base_url=server.url, timeout=5) as client:
                metrics = client.get("/metrics").text
                counted = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in metrics.splitlines()
                    if line.startswith("sluice_requests_total{") and 'model="mlp"' in line
                )
                stats = client.get("/v2/models/mlp/stats").json()["model_stats"][0]
                ready = client.get("/v2/health/ready").status_code == 200
                index = client.post("/v2/repository/index").text
                seen.append((counted, stats["inference_count"], ready, index))
        return seen

    # Front-end counts reach the engine within EVENTS_INTERVAL_S: poll, bounded.
    wait_for(lambda: {v[0] for v in views()} == {float(CLIENTS)}, "every count in /metrics")
    assert set(views()) == {(float(CLIENTS), CLIENTS, True, views()[0][3])}
    assert '"state":"READY"' in views()[0][3]


ARENA_BYTES = Settings.model_fields["worker_arena_bytes"].default


def worker_samples(server: ServerProcess) -> dict[str, float]:
    """The sluice_worker_* samples of /metrics, by their line up to the value."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("sluice_worker_")}  # fmt: skip


def test_arenas_are_all_free_once_answers_are_sent(server: ServerProcess) -> None:
    x = np.zeros((4, 16), np.float32)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for _ in range(10):
            assert client.post("/v2/models/mlp/infer", json=json_body(x)).status_code == 200

    # An out-slot is freed when the worker has encoded it and said so: poll, bounded.
    def used() -> dict[str, float]:
        return {name: value for name, value in worker_samples(server).items()
                if name.startswith("sluice_worker_arena_used_bytes")}  # fmt: skip

    wait_for(lambda: set(used().values()) == {0}, f"every arena slot freed ({used()})")
    samples = worker_samples(server)
    for worker in ("0", "1"):
        assert samples[f'sluice_worker_connected{{worker="{worker}"}}'] == 1
        for arena in ("in", "out"):
            labels = f'{{arena="{arena}",worker="{worker}"}}'
            assert samples[f"sluice_worker_arena_bytes{labels}"] == ARENA_BYTES
            assert f"sluice_worker_arena_used_bytes{labels}" in samples


def mismatched_add_model() -> onnx.ModelProto:
    """x + y over dims the config leaves free: inputs of different widths pass every check and
    fail in ONNX Runtime (a backend error, as an out-of-memory or a bad kernel would be)."""
    value = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "y"], ["z"])], "add",
        [value("x", onnx.TensorProto.FLOAT, ["b", "n"]),
         value("y", onnx.TensorProto.FLOAT, ["b", "m"])],
        [value("z", onnx.TensorProto.FLOAT, ["b", "n"])],
    )  # fmt: skip
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_failed_requests_leave_no_arena_slot_taken(tmp_path: Path, repo: Path) -> None:
    """A request whose batch failed in the backend kept its in-arena slot until the engine's
    cyclic collector ran (seldom: the server raises its thresholds), so a few large failures
    filled a worker's arena and every request after them was refused 503."""
    write_model(repo, "add", mismatched_add_model(), "max_batch_size: 4\n")
    server = serve(tmp_path, "--model-repository", str(repo))
    try:
        x = {"name": "x", "datatype": "FP32", "shape": [1, 100_000], "data": [1.0] * 100_000}
        y = {"name": "y", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.0, 3.0]}
        body: dict[str, object] = {"inputs": [x, y]}
        replies = asyncio.run(fresh_posts(f"{server.url}/v2/models/add/infer", [body] * 6))
        assert {reply.status_code for reply in replies} == {500}, replies[0].text

        def used() -> dict[str, float]:
            return {name: value for name, value in worker_samples(server).items()
                    if name.startswith("sluice_worker_arena_used_bytes")}  # fmt: skip

        wait_for(lambda: set(used().values()) == {0}, f"every arena slot freed ({used()})")
    finally:
        server.stop()


def owner(client_ports: set[int], candidates: list[psutil.Process]) -> psutil.Process | None:
    """The worker holding the server end of one of `client_ports`' connections."""
    for worker in candidates:
        if any(c.raddr and c.raddr.port in client_ports for c in worker.net_connections("tcp")):
            return worker
    return None


def my_ports(server_port: int) -> set[int]:
    mine = psutil.Process().net_connections(kind="tcp")
    return {c.laddr.port for c in mine if c.raddr and c.raddr.port == server_port}


def test_a_killed_worker_is_restarted_and_the_other_keeps_serving(
    server: ServerProcess,
) -> None:
    both = workers(server)
    x = np.ones((1, 16), np.float32)
    for _ in range(50):  # a keep-alive connection that a known worker accepted
        kept = httpx.Client(base_url=server.url, timeout=5)
        assert kept.get("/v2/health/ready").status_code == 200
        survivor = owner(my_ports(server.http_port), both)
        if survivor is not None:
            break
        kept.close()
    assert survivor is not None
    (victim,) = [w for w in both if w.pid != survivor.pid]
    restarts = 'sluice_worker_restarts_total{worker="%s"}'
    assert {worker_samples(server)[restarts % w] for w in "01"} == {0}
    try:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        for _ in range(20):  # the survivor's connection is unaffected throughout
            answer = kept.post("/v2/models/mlp/infer", json=json_body(x))
            assert answer.status_code == 200, answer.text
    finally:
        kept.close()
    wait_for(
        lambda: len(workers(server)) == 2 and victim.pid not in {w.pid for w in workers(server)},
        "a new worker in the dead one's place",
    )
    with httpx.Client(base_url=server.url, timeout=5) as client:
        assert client.post("/v2/models/mlp/infer", json=json_body(x)).status_code == 200
    assert sorted(worker_samples(server)[restarts % w] for w in "01") == [0, 1]


PROBE_TIMEOUT_S = 2.0
"""A request the worker answers on its own is answered within this, whatever the engine does (a
call to the engine is given up only after server.link.remote_control.CALL_TIMEOUT_S, 10 s)."""


def connections_to_one_worker(server: ServerProcess, count: int) -> list[HTTPConnection]:
    """`count` keep-alive connections that one worker holds (each answered once, so accepted:
    the kernel gives a new connection to either worker by a hash of its port)."""
    both = workers(server)
    by_worker: dict[int, list[HTTPConnection]] = {}
    try:
        for _ in range(100):
            connection = HTTPConnection("127.0.0.1", server.http_port, timeout=10)
            try:
                connection.request("GET", "/v2/health/live")
                assert connection.getresponse().read() == b'{"live":true}'
                assert connection.sock is not None
                holder = owner({connection.sock.getsockname()[1]}, both)
                assert holder is not None
            except BaseException:
                connection.close()
                raise
            mine = by_worker.setdefault(holder.pid, [])
            mine.append(connection)
            if len(mine) == count:
                return by_worker.pop(holder.pid)
        raise AssertionError(f"no worker took {count} of 100 connections")
    finally:  # the other worker's
        for connection in (c for connections in by_worker.values() for c in connections):
            connection.close()


def unread_bytes(server_port: int, connection: HTTPConnection) -> int:
    """What the server end of `connection` holds that its worker has not read yet (its rx_queue
    in /proc/net/tcp)."""
    assert connection.sock is not None
    client_port = connection.sock.getsockname()[1]
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local, remote, queues = fields[1], fields[2], fields[4]
            ports = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
            if ports == (server_port, client_port):
                return int(queues.split(":")[1], 16)
    raise AssertionError(f"no connection from port {client_port} to {server_port}")


def test_a_worker_answers_on_its_own_while_the_engine_does_not_answer_it(
    server: ServerProcess,
) -> None:
    """Metadata, config, statistics, /metrics and a model's first declared-shape check were
    blocking calls to the engine: while one waited (up to 10 s for an engine busy loading,
    overloaded or stopped), the worker's whole event loop waited with it, and so did every other
    request it held, its liveness probe too. Here the engine process is stopped (SIGSTOP) while
    each of them is asked of one worker, and that worker must answer a liveness probe at once;
    once the engine runs again, every call it held is answered as if nothing had happened."""
    x = np.random.default_rng(7).standard_normal((2, 16)).astype(np.float32)
    asked = [
        ("GET", "/v2/models/mlp/stats", None),
        ("GET", "/v2/models/mlp/config", None),
        ("GET", "/v2/models/mlp", None),
        ("GET", "/metrics", None),
        ("POST", "/v2/models/mlp/infer", orjson.dumps(json_body(x))),  # its first: input_spec
    ]
    connections = connections_to_one_worker(server, len(asked) + 1)
    *calls, probe = connections
    assert probe.sock is not None
    probe.sock.settimeout(PROBE_TIMEOUT_S)
    engine = engine_process(server)
    answers = {}
    try:
        engine.suspend()  # SIGSTOP: it reads nothing and answers nothing until SIGCONT
        try:
            for connection, (method, path, body) in zip(calls, asked, strict=True):
                connection.request(method, path, body=body)
                wait_for(
                    lambda c=connection: unread_bytes(server.http_port, c) == 0,
                    f"the worker reading {path}",
                    timeout_s=5.0,
                )
                probe.request("GET", "/v2/health/live")
                try:
                    live = probe.getresponse()
                except TimeoutError:
                    pytest.fail(
                        f"/v2/health/live was not answered in {PROBE_TIMEOUT_S} s while the "
                        f"worker waited for the engine's answer to {method} {path}"
                    )
                assert (live.status, live.read()) == (200, b'{"live":true}')
        finally:
            engine.resume()  # SIGCONT, whatever happened: never leave a stopped process behind
        for connection, (_, path, _) in zip(calls, asked, strict=True):
            response = connection.getresponse()  # each was held, not refused or timed out
            answers[path] = (response.status, response.read())
    finally:
        for connection in connections:
            connection.close()
    assert {status for status, _ in answers.values()} == {200}, answers
    stats = orjson.loads(answers["/v2/models/mlp/stats"][1])
    assert stats["model_stats"][0]["name"] == "mlp"
    config = orjson.loads(answers["/v2/models/mlp/config"][1])
    assert (config["name"], config["max_batch_size"]) == ("mlp", 64)
    assert orjson.loads(answers["/v2/models/mlp"][1])["inputs"][0]["shape"] == [-1, 16]
    assert b'sluice_worker_connected{worker="0"} 1.0' in answers["/metrics"][1]  # the engine's
    outputs = orjson.loads(answers["/v2/models/mlp/infer"][1])["outputs"][0]
    got = np.array(outputs["data"], np.float32).reshape(2, 10)
    np.testing.assert_allclose(got, expected(x), rtol=1e-5)


def test_the_supervisor_exits_non_zero_when_the_engine_dies(server: ServerProcess) -> None:
    children = [*workers(server), engine_process(server)]
    children[-1].send_signal(signal.SIGKILL)
    assert server.wait(20) == 1
    _, alive = psutil.wait_procs(children, timeout=5)
    assert alive == []  # the workers stopped with it: nothing is left serving


def test_connections_made_as_the_engine_dies_are_answered_or_refused(
    server: ServerProcess,
) -> None:
    """A worker stopped on its own when it lost the engine, closing its listening socket while
    the supervisor's copy of it still listened until the supervisor's next poll (200 ms): the
    kernel accepted the connections made meanwhile, their requests were written, and they were
    reset when the supervisor closed its copy. Each must get an answer (503) or be refused."""
    body = orjson.dumps(json_body(np.zeros((1, 16), np.float32)))
    request = (
        b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: sluice\r\nconnection: close\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    engine_process(server).send_signal(signal.SIGKILL)
    answers: list[bytes] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            client = socket.create_connection(("127.0.0.1", server.http_port), timeout=5)
        except ConnectionRefusedError:
            break  # the server stopped listening: nothing was sent
        with client:
            client.sendall(request)
            answer = b""
            while chunk := client.recv(65536):  # a reset raises here
                answer += chunk
        answers.append(answer.split(b"\r\n", 1)[0])
    else:
        raise AssertionError("the server kept listening after its engine died")
    assert set(answers) <= {b"HTTP/1.1 503 Service Unavailable"}, answers
    assert server.wait(20) == 1


async def test_a_model_loaded_through_one_worker_serves_on_every_worker(
    tmp_path: Path, repo: Path
) -> None:
    server = serve(tmp_path, "--model-repository", str(repo), "--model-control-mode", "explicit")
    try:
        url = f"{server.url}/v2/models/mlp/infer"
        x = np.zeros((1, 16), np.float32)
        assert {a.status_code for a in await fresh_posts(url, [json_body(x)] * 8)} == {404}
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            # Triton's `config` load parameter reaches the engine with its value.
            config = {"parameters": {"config": '{"max_batch_size": 8}'}}
            loaded = await client.post("/v2/repository/models/mlp/load", json=config)
            assert loaded.status_code == 200, loaded.text
            assert (await client.get("/v2/models/mlp/config")).json()["max_batch_size"] == 8
            assert (await client.post("/v2/repository/models/mlp/load")).status_code == 200
        # The other worker learns of it within the engine's state push (100 ms): poll, bounded.
        deadline = time.monotonic() + 5
        while {a.status_code for a in await fresh_posts(url, [json_body(x)] * 8)} != {200}:
            assert time.monotonic() < deadline, "a worker never served the loaded model"
        async with httpx.AsyncClient(
            base_url=server.url, limits=httpx.Limits(max_keepalive_connections=0)
        ) as client:
            usages = [(await client.get("/v2/tenants/self/usage")) for _ in range(4)]
            assert {u.status_code for u in usages} == {200}
            # The same figures from every worker; `as_of` is the second each was asked in.
            answers = [{k: v for k, v in u.json().items() if k != "as_of"} for u in usages]
            assert all(answer == answers[0] for answer in answers)
            assert (await client.post("/v2/repository/models/mlp/unload")).status_code == 200
        deadline = time.monotonic() + 5
        while {a.status_code for a in await fresh_posts(url, [json_body(x)] * 8)} != {404}:
            assert time.monotonic() < deadline, "a worker still served the unloaded model"
    finally:
        server.stop()


SLOW_LOAD_PY = """
import time


class SlowLoad:
    def load(self, config):
        time.sleep(5.0)  # a connection queued meanwhile would be held past the probe's 3 s

    def infer(self, inputs):
        return {"y": inputs["x"]}
"""
SLOW_LOAD_CONFIG = """backend: python
python:
  inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
  outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""


async def test_connections_are_refused_not_held_while_the_engine_loads(tmp_path: Path) -> None:
    """The supervisor listened on the HTTP port before the engine had loaded its models: a
    connection was taken by the kernel and held unanswered until a worker started (minutes,
    for a model that builds an engine), where one process refuses it."""
    import socket

    models = tmp_path / "models"
    (models / "slow" / "1").mkdir(parents=True)
    (models / "slow" / "1" / "model.py").write_text(SLOW_LOAD_PY)
    (models / "slow" / "config.yaml").write_text(SLOW_LOAD_CONFIG)
    server = ServerProcess(
        "--workers", "2", "--model-repository", str(models), "--allow-python-models",
        log_path=tmp_path / "server.log",
    )  # fmt: skip

    def probe() -> str:
        try:
            # 3 s: a connection made as the workers start waits for one to serve (about a
            # second where their modules are not compiled yet), not for the models to load
            with socket.create_connection(("127.0.0.1", server.http_port), 3) as client:
                client.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                return "answered" if client.recv(100).startswith(b"HTTP/1.1") else "odd"
        except ConnectionRefusedError:
            return "refused"  # nothing listens: the client tries elsewhere, or again
        except TimeoutError:
            return "held"

    starting = asyncio.create_task(asyncio.to_thread(server.start, 60.0))
    outcomes = []
    try:
        while not starting.done():
            outcomes.append(probe())
            await asyncio.sleep(0.05)  # pacing, not synchronization
        await starting
        assert outcomes.count("held") == 0, outcomes
        assert probe() == "answered"  # the same probe, once the workers serve
    finally:
        server.stop()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_signal_while_the_models_load_stops_the_server_at_once(
    tmp_path: Path, workers: str
) -> None:
    """SIGTERM waited for the load to end (the supervisor for the engine's ready, one process
    for engine.start), then served and drained: a load of minutes outlived the orchestrator's
    grace period. Nothing is served yet, so nothing is lost by stopping at once."""
    marker = tmp_path / "loading"
    models = tmp_path / "models"
    (models / "slow" / "1").mkdir(parents=True)
    (models / "slow" / "1" / "model.py").write_text(
        SLOW_LOAD_PY.replace("time.sleep(5.0)", f"open({str(marker)!r}, 'w').close()\n"
                             "        time.sleep(30.0)")
    )  # fmt: skip
    (models / "slow" / "config.yaml").write_text(SLOW_LOAD_CONFIG)
    server = ServerProcess(
        "--workers", workers, "--model-repository", str(models), "--allow-python-models",
        log_path=tmp_path / "server.log",
    )  # fmt: skip
    server.launch()  # never ready: the load takes 30 s
    try:
        wait_for(marker.exists, "the model's load to begin")
        server.terminate()
        assert server.wait(5) == 0, server.logs()
    finally:
        server.stop()


HELD_LOAD_PY = """
import pathlib
import time


class HeldLoad:
    def load(self, config):
        pathlib.Path({loading!r}).touch()
        deadline = time.monotonic() + 30.0  # bounded: a failed test never hangs its server
        while not pathlib.Path({release!r}).exists() and time.monotonic() < deadline:
            time.sleep(0.005)  # the test's hold: released when the file appears

    def infer(self, inputs):
        return {{"y": inputs["x"]}}
"""


async def fresh_gets(url: str, count: int = 8) -> set[int]:
    """The statuses of `count` GETs, one per new connection (they land on both workers)."""
    async with httpx.AsyncClient(
        timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
    ) as client:
        return {
            r.status_code for r in await asyncio.gather(*(client.get(url) for _ in range(count)))
        }


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_readiness_turns_503_as_an_explicit_load_begins_on_every_worker(
    tmp_path: Path, workers: str
) -> None:
    """With strict readiness a server is unready while a model it was asked for loads. One
    process answered 503 from the load's first moment; a worker answered from the engine's last
    state push (every 100 ms, later while the load kept the engine busy), so 200 for a while."""
    loading, release = tmp_path / "loading", tmp_path / "release"
    models = tmp_path / "models"
    (models / "held" / "1").mkdir(parents=True)
    (models / "held" / "1" / "model.py").write_text(
        HELD_LOAD_PY.format(loading=str(loading), release=str(release))
    )
    (models / "held" / "config.yaml").write_text(SLOW_LOAD_CONFIG)
    server = ServerProcess(
        "--workers", workers, "--model-repository", str(models), "--allow-python-models",
        "--model-control-mode", "explicit", log_path=tmp_path / "server.log",
    )  # fmt: skip
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for _ in range(3):  # a worker's stale copy was caught by most rounds, not every one
                loading.unlink(missing_ok=True)
                release.unlink(missing_ok=True)
                load = asyncio.create_task(client.post("/v2/repository/models/held/load"))
                while not loading.exists():  # the load has begun: the model's load() holds it
                    assert not load.done(), (await load).text
                    await asyncio.sleep(0.001)  # polling a condition
                assert await fresh_gets(f"{server.url}/v2/health/ready") == {503}
                assert await fresh_gets(f"{server.url}/v2/models/held/ready") == {503}
                release.touch()
                assert (await load).status_code == 200, (await load).text
                assert await fresh_gets(f"{server.url}/v2/health/ready") == {200}
                assert await fresh_gets(f"{server.url}/v2/models/held/ready") == {200}
                unloaded = await client.post("/v2/repository/models/held/unload")
                assert unloaded.status_code == 200, unloaded.text
    finally:
        release.touch()
        server.stop()
