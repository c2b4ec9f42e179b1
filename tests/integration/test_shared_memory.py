"""Triton's system shared-memory extension against a real `sluice serve`, with tritonclient's own
utilities (`tritonclient.utils.shared_memory`: files in /dev/shm, as shm_open makes them) over
HTTP and gRPC, and the attacks a registered region opens: another tenant's region, offsets past
the end, a symlink, thousands of registrations, a file shrunk or unlinked under load, a revoked
key. Each is answered 4xx, the server keeps serving, and no file stays open.

The CUDA shared-memory extension against the same server, whose cuda-python is the fake of
tests/fakes (first on its PYTHONPATH, as a real install is found): this process allocates
device memory on its own fake runtime and registers the IPC handle; the two share that memory
through /dev/shm as two processes share device memory. The `gpu`-marked test runs tritonclient's
real `cuda_shared_memory` utilities against a server on a real GPU (scripts/gpu-check.sh).

tritonclient.grpc cannot be imported in the pytest process (see test_tritonclient.py): its calls
run in a child process, this file run as a script (`python test_shared_memory.py grpc URL KEY`),
which prints its results as JSON."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

SHM = Path("/dev/shm")
ROOT = Path(__file__).resolve().parents[2]
KEYS = {"acme": "key-acme", "acme2": "key-acme-2", "beta": "key-beta"}
"""Key name -> key; `acme` and `acme2` are two keys of tenant acme, `beta` is tenant beta."""
TENANTS = {"acme": "acme", "acme2": "acme", "beta": "beta"}
MAX_REGIONS = 32

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this host")


def demo_x(seed: int, rows: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)


def open_regions(pid: int) -> int:
    """How many files of /dev/shm made by these tests process `pid` holds open."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/sluice-test-")
    return count


def holders(root: int, key: str) -> int:
    """How many processes of the tree under `root` hold file `key` of /dev/shm open."""
    count, todo = 0, [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(FileNotFoundError):
            for task in os.listdir(f"/proc/{pid}/task"):
                todo += map(int, Path(f"/proc/{pid}/task/{task}/children").read_text().split())
            count += any(
                os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/dev/shm{key}")
                for fd in os.listdir(f"/proc/{pid}/fd")
            )
    return count


def write_keys(path: Path, names: list[str]) -> None:
    from engine.auth import digest_key

    lines = ["keys:"]
    for name in names:
        lines += [
            f"  - name: {name}",
            f"    tenant: {TENANTS[name]}",
            f"    digest: '{digest_key(KEYS[name])}'",
        ]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shm-keys") / "keys.yaml"
    write_keys(path, list(KEYS))
    return path


@pytest.fixture(scope="module")
def sluice(tmp_path_factory: pytest.TempPathFactory, keys_file: Path) -> Iterator[Any]:
    from tests.fakes.install import write_shims
    from tests.integration.helpers_e2e import cache_config, demo_repository
    from tests.servers import ServerProcess

    root = tmp_path_factory.mktemp("shm-server")
    repo = demo_repository(root / "repo", {"demo": "max_batch_size: 64\n" + cache_config()})
    shims = write_shims(root / "site", tensorrt=False, nvml=False)  # cuda-python only
    env = {
        "PYTHONPATH": f"{shims}:{ROOT}",
        "SLUICE_SHARED_MEMORY__ENABLED": "true",
        "SLUICE_SHARED_MEMORY__MAX_REGIONS_PER_TENANT": str(MAX_REGIONS),
        "SLUICE_AUTH__KEYS_FILE": str(keys_file),
        "SLUICE_AUTH__KEYS_FILE_POLL_INTERVAL_S": "0.1",
    }
    server = ServerProcess(
        "--model-repository", str(repo), env=env, log_path=root / "server.log"
    ).start()
    yield server
    server.stop()


class Regions:
    """tritonclient's shared-memory regions made by a test, destroyed after it."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.tag = uuid.uuid4().hex[:8]

    def create(self, name: str, size: int) -> tuple[Any, str]:
        import tritonclient.utils.shared_memory as shm

        key = f"/sluice-test-{self.tag}-{name}"
        handle = shm.create_shared_memory_region(name, key, size)
        self.handles.append(handle)
        return handle, key

    def destroy(self) -> None:
        import tritonclient.utils.shared_memory as shm

        for handle in self.handles:
            try:
                shm.destroy_shared_memory_region(handle)
            except Exception:  # a test unlinked it already
                handle._mpsm_handle.close()


@pytest.fixture
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.destroy()


def http_client(server: Any) -> Any:
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")


def headers(name: str) -> dict[str, str]:
    return {"x-api-key": KEYS[name]}


def reference(server: Any, x: np.ndarray) -> np.ndarray:
    """The demo model's answer for `x`, sent in the request."""
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = http_client(server).infer("demo", [tensor], headers=headers("acme"))
    answer: np.ndarray = result.as_numpy("probabilities")
    return answer


def shm_infer(client: Any, region: str, x_shape: list[int], byte_size: int, **kw: Any) -> Any:
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("x", x_shape, "FP32")
    tensor.set_shared_memory(region, byte_size, offset=kw.pop("offset", 0))
    return client.infer("demo", [tensor], **kw)


def status_of(call: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    """`call(*args, **kwargs)`'s HTTP status as tritonclient reports it, and its message."""
    from tritonclient.utils import InferenceServerException

    try:
        call(*args, **kwargs)
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    return "200", ""


# -- round trips -----------------------------------------------------------------------------------


def test_http_round_trip_with_tritonclient(sluice: Any, regions: Regions) -> None:
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    client, acme = http_client(sluice), headers("acme")
    assert "system_shared_memory" in client.get_server_metadata(headers=acme)["extensions"]
    x = demo_x(1)
    into, in_key = regions.create("in", 64 + x.nbytes)
    out, out_key = regions.create("out", 2 * 10 * 4)
    shm.set_shared_memory_region(into, [x], offset=64)
    client.register_system_shared_memory("in", in_key, x.nbytes, offset=64, headers=acme)
    client.register_system_shared_memory("out", out_key, 80, headers=acme)
    assert client.get_system_shared_memory_status(headers=acme) == [
        {"name": "in", "key": in_key, "offset": 64, "byte_size": x.nbytes},
        {"name": "out", "key": out_key, "offset": 0, "byte_size": 80},
    ]
    tensor = httpclient.InferInput("x", [2, 16], "FP32")
    tensor.set_shared_memory("in", x.nbytes)
    wanted = httpclient.InferRequestedOutput("probabilities", binary_data=True)
    wanted.set_shared_memory("out", 80)
    result = client.infer("demo", [tensor], outputs=[wanted], headers=acme)
    assert result.get_output("probabilities") == {  # no data: it is in the region
        "name": "probabilities",
        "datatype": "FP32",
        "shape": [2, 10],
    }
    got = shm.get_contents_as_numpy(out, np.float32, [2, 10])
    np.testing.assert_allclose(got, reference(sluice, x), rtol=1e-6)
    client.unregister_system_shared_memory("in", headers=acme)
    assert [r["name"] for r in client.get_system_shared_memory_status(headers=acme)] == ["out"]
    client.unregister_system_shared_memory(headers=acme)
    assert client.get_system_shared_memory_status(headers=acme) == []


def grpc_calls(url: str, key: str, in_key: str, out_key: str) -> dict[str, Any]:
    """The tritonclient.grpc calls of the gRPC round trip; runs in the child process."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    client = grpcclient.InferenceServerClient(url)
    meta = [("x-api-key", key)]
    into = shm.create_shared_memory_region("in", in_key, 128, create_only=False)
    out = shm.create_shared_memory_region("out", out_key, 80, create_only=False)
    x = demo_x(2)
    shm.set_shared_memory_region(into, [x])
    client.register_system_shared_memory("in", in_key, 128, headers=dict(meta))
    client.register_system_shared_memory("out", out_key, 80, headers=dict(meta))
    status = client.get_system_shared_memory_status(headers=dict(meta), as_json=True)
    tensor = grpcclient.InferInput("x", [2, 16], "FP32")
    tensor.set_shared_memory("in", 128)
    wanted = grpcclient.InferRequestedOutput("probabilities")
    wanted.set_shared_memory("out", 80)
    result = client.infer("demo", [tensor], outputs=[wanted], headers=dict(meta))
    got = shm.get_contents_as_numpy(out, np.float32, [2, 10]).copy()  # a view of the mapping
    client.unregister_system_shared_memory(headers=dict(meta))
    after = client.get_system_shared_memory_status(headers=dict(meta), as_json=True)
    shm.destroy_shared_memory_region(into)
    shm.destroy_shared_memory_region(out)
    return {
        "status": sorted(status["regions"]),
        "outputs": [o.name for o in result.get_response().outputs],
        "got": got.tolist(),
        "after": after.get("regions", {}),
    }


def test_grpc_round_trip_with_tritonclient(sluice: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    args = [sluice.grpc_url, KEYS["acme"], f"/sluice-test-{tag}-gin", f"/sluice-test-{tag}-gout"]
    done = subprocess.run(
        [sys.executable, __file__, "grpc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["status"] == ["in", "out"]
    assert out["outputs"] == ["probabilities"]
    np.testing.assert_allclose(out["got"], reference(sluice, demo_x(2)), rtol=1e-6)
    assert out["after"] == {}


def test_off_by_default(demo_server: Any, regions: Regions) -> None:
    client = http_client(demo_server)
    assert "system_shared_memory" not in client.get_server_metadata()["extensions"]
    _, key = regions.create("in", 128)
    code, message = status_of(lambda: client.register_system_shared_memory("in", key, 128))
    assert code == "403"
    assert "SLUICE_SHARED_MEMORY__ENABLED=true" in message
    code, message = status_of(lambda: shm_infer(client, "in", [2, 16], 128))
    assert code == "403"
    assert "shared_memory.enabled" in message


def test_cache_keys_on_the_bytes_in_the_region(sluice: Any, regions: Regions) -> None:
    import tritonclient.utils.shared_memory as shm

    client, acme = http_client(sluice), headers("acme")
    x = demo_x(3)
    into, in_key = regions.create("cin", x.nbytes)
    out, out_key = regions.create("cout", 80)
    shm.set_shared_memory_region(into, [x])
    client.register_system_shared_memory("cin", in_key, x.nbytes, headers=acme)
    client.register_system_shared_memory("cout", out_key, 80, headers=acme)
    import tritonclient.http as httpclient

    def run() -> tuple[bool | None, np.ndarray]:
        wanted = httpclient.InferRequestedOutput("probabilities")
        wanted.set_shared_memory("cout", 80)
        shm.set_shared_memory_region(out, [np.zeros((2, 10), np.float32)])
        tensor = httpclient.InferInput("x", [2, 16], "FP32")
        tensor.set_shared_memory("cin", x.nbytes)
        result = client.infer("demo", [tensor], outputs=[wanted], headers=acme)
        hit = (result.get_response().get("parameters") or {}).get("cache_hit")
        return hit, shm.get_contents_as_numpy(out, np.float32, [2, 10]).copy()

    first, first_out = run()
    second, second_out = run()
    assert (first, second) == (False, True)
    np.testing.assert_array_equal(second_out, first_out)  # a hit is written into the region too
    np.testing.assert_allclose(first_out, reference(sluice, x), rtol=1e-6)
    shm.set_shared_memory_region(into, [demo_x(4)])  # new bytes, same region: a new key
    third, third_out = run()
    assert third is False
    np.testing.assert_allclose(third_out, reference(sluice, demo_x(4)), rtol=1e-6)
    client.unregister_system_shared_memory(headers=acme)


def test_perf_analyzer_over_system_shared_memory(start_server: Any) -> None:
    perf_analyzer = Path(sys.executable).parent / "perf_analyzer"
    if not perf_analyzer.exists():
        pytest.skip("perf_analyzer is not installed (./dev.sh test installs it)")
    # No keys: perf_analyzer sends no header over gRPC (its -H is for HTTP only).
    server = start_server(env={"SLUICE_SHARED_MEMORY__ENABLED": "true"})
    # One after the other: each begins by unregistering every region of its tenant (anonymous).
    for protocol in ("http", "grpc"):
        url = server.grpc_url if protocol == "grpc" else server.url.removeprefix("http://")
        command = [
            str(perf_analyzer), "-m", "demo", "-u", url, "-i", protocol, "-b", "2",
            "--shared-memory", "system", "--output-shared-memory-size", "1024",
            "--concurrency-range", "2", "--measurement-mode", "count_windows",
            "--measurement-request-count", "100", "--max-trials", "10",
            "--stability-percentage", "999",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=100, check=False)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        assert "throughput: " in output, output
        # Its regions were registered, used and unregistered without a single error.
        assert "error" not in output.lower(), output
        assert "Unable" not in output, output
    assert http_client(server).get_system_shared_memory_status() == []


def test_regions_registered_through_one_worker_serve_through_all(
    start_server: Any, regions: Regions
) -> None:
    import httpx
    import tritonclient.utils.shared_memory as shm

    from tests.integration.helpers_e2e import wait_for

    server = start_server("--workers", "2", env={"SLUICE_SHARED_MEMORY__ENABLED": "true"})
    x = demo_x(9)
    into, in_key = regions.create("win", x.nbytes)
    out, out_key = regions.create("wout", 80)
    shm.set_shared_memory_region(into, [x])
    http_client(server).register_system_shared_memory("win", in_key, x.nbytes)
    http_client(server).register_system_shared_memory("wout", out_key, 80)
    params = {"shared_memory_region": "win", "shared_memory_byte_size": x.nbytes}
    out_params = {"shared_memory_region": "wout", "shared_memory_byte_size": 80}
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 16], "parameters": params}],
        "outputs": [{"name": "probabilities", "parameters": out_params}],
    }
    expected = reference(server, x)
    # A connection each: the kernel spreads them over both workers, which must all know the
    # regions (20 on one worker alone would be a 1 in 500 000 chance).
    for _ in range(20):
        shm.set_shared_memory_region(out, [np.zeros((2, 10), np.float32)])
        with httpx.Client(base_url=server.url, timeout=10) as http:
            response = http.post("/v2/models/demo/infer", json=body)
        assert response.status_code == 200, response.text
        got = shm.get_contents_as_numpy(out, np.float32, [2, 10]).copy()
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    # The engine process and both workers hold the file: each worker opened it to read.
    assert holders(server.process.pid, in_key) == 3
    http_client(server).unregister_system_shared_memory("win")
    with httpx.Client(base_url=server.url, timeout=10) as http:
        gone = http.post("/v2/models/demo/infer", json=body)
    assert gone.status_code == 404
    http_client(server).unregister_system_shared_memory()
    wait_for(lambda: holders(server.process.pid, out_key) == 0 or None, 10, "files closed")
    assert holders(server.process.pid, in_key) == 0
    cuda = {"raw_handle": {"b64": "A" * 88}, "device_id": 0, "byte_size": 64}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        refused = http.post("/v2/cudasharedmemory/region/c/register", json=cuda)
    assert refused.status_code == 400
    assert "which --workers N > 1 does not give" in refused.json()["error"]


# -- CUDA shared memory ----------------------------------------------------------------------------


@pytest.fixture
def cuda_client() -> Iterator[Any]:
    from tests.fakes.cuda_client import IpcClient

    client = IpcClient()
    yield client
    client.free()


def test_cuda_regions_over_http_and_grpc(sluice: Any, cuda_client: Any) -> None:
    import grpc
    import httpx
    import tritonclient.http as httpclient

    from server.grpc.proto import grpc_service_pb2 as pb
    from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc

    x = demo_x(11)
    _, in_handle = cuda_client.allocate(x.tobytes())
    out_ptr, out_handle = cuda_client.allocate(bytes(80))
    acme, meta = headers("acme"), [("x-api-key", KEYS["acme"])]
    register = {"raw_handle": {"b64": cuda_client.b64(in_handle)}, "byte_size": x.nbytes}
    with (
        httpx.Client(base_url=sluice.url, headers=acme, timeout=10) as http,
        grpc.insecure_channel(sluice.grpc_url) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        wrong = http.post("/v2/cudasharedmemory/region/cin/register", json=register)
        assert wrong.status_code == 400  # no device_id
        assert "device_id must be an integer >= 0, got None" in wrong.json()["error"]
        answer = http.post(
            "/v2/cudasharedmemory/region/cin/register", json={**register, "device_id": 0}
        )
        assert answer.status_code == 200, answer.text
        out = pb.CudaSharedMemoryRegisterRequest(
            name="cout", raw_handle=out_handle, device_id=0, byte_size=80
        )
        stub.CudaSharedMemoryRegister(out, metadata=meta)
        status = stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(), metadata=meta)
        assert sorted(status.regions) == ["cin", "cout"]
        assert http.get("/v2/cudasharedmemory/region/cout/status").json() == [
            {"name": "cout", "device_id": 0, "byte_size": 80}
        ]
        tensor = httpclient.InferInput("x", [2, 16], "FP32")
        tensor.set_shared_memory("cin", x.nbytes)
        wanted = httpclient.InferRequestedOutput("probabilities", binary_data=True)
        wanted.set_shared_memory("cout", 80)
        result = http_client(sluice).infer("demo", [tensor], outputs=[wanted], headers=acme)
        assert result.get_output("probabilities")["shape"] == [2, 10]
        got = np.frombuffer(cuda_client.get(out_ptr, 80), np.float32).reshape(2, 10)
        np.testing.assert_allclose(got, reference(sluice, x), rtol=1e-6)
        code, _ = status_of(lambda: shm_infer(http_client(sluice), "cin", [2, 16], x.nbytes))
        assert code == "401"
        beta = headers("beta")
        code, message = status_of(
            lambda: shm_infer(http_client(sluice), "cin", [2, 16], x.nbytes, headers=beta)
        )
        assert (code, message) == (
            "404",
            "no shared memory region 'cin' is registered by this tenant",
        )
        stub.CudaSharedMemoryUnregister(
            pb.CudaSharedMemoryUnregisterRequest(name="cin"), metadata=meta
        )
        assert [row["name"] for row in http.get("/v2/cudasharedmemory/status").json()] == ["cout"]
        assert http.post("/v2/cudasharedmemory/unregister").status_code == 200
        assert http.get("/v2/cudasharedmemory/status").json() == []


@pytest.mark.gpu
def test_tritonclient_cuda_shared_memory_on_a_gpu(start_server: Any) -> None:
    from tests.fakes.install import real_cuda

    runtime, why_not = real_cuda()
    if runtime is None:
        pytest.skip(why_not)
    import cuda.bindings.driver as driver

    if not hasattr(driver, "cuDeviceGet"):  # gpu-check.sh's stand-in driver has only ours
        pytest.skip("tritonclient's cuda_shared_memory needs the full CUDA driver API")
    import tritonclient.http as httpclient
    import tritonclient.utils.cuda_shared_memory as cudashm

    server = start_server(env={"SLUICE_SHARED_MEMORY__ENABLED": "true"})
    client, x = http_client(server), demo_x(12)
    into = cudashm.create_shared_memory_region("gin", x.nbytes, 0)
    out = cudashm.create_shared_memory_region("gout", 80, 0)
    try:
        cudashm.set_shared_memory_region(into, [x])
        client.register_cuda_shared_memory("gin", cudashm.get_raw_handle(into), 0, x.nbytes)
        client.register_cuda_shared_memory("gout", cudashm.get_raw_handle(out), 0, 80)
        assert client.get_cuda_shared_memory_status() == [
            {"name": "gin", "device_id": 0, "byte_size": x.nbytes},
            {"name": "gout", "device_id": 0, "byte_size": 80},
        ]
        tensor = httpclient.InferInput("x", [2, 16], "FP32")
        tensor.set_shared_memory("gin", x.nbytes)
        wanted = httpclient.InferRequestedOutput("probabilities", binary_data=True)
        wanted.set_shared_memory("gout", 80)
        client.infer("demo", [tensor], outputs=[wanted])
        got = cudashm.get_contents_as_numpy(out, np.float32, [2, 10])
        np.testing.assert_allclose(got, reference(server, x), rtol=1e-6)
        code, message = status_of(
            client.register_cuda_shared_memory, "big", cudashm.get_raw_handle(into), 0, 1 << 30
        )
        assert (code, "passes the end of the device allocation" in message) == ("400", True)
        client.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status() == []
    finally:
        cudashm.destroy_shared_memory_region(into)
        cudashm.destroy_shared_memory_region(out)


# -- attacks ---------------------------------------------------------------------------------------


def test_another_tenants_region_is_unknown_to_it(sluice: Any, regions: Regions) -> None:
    import tritonclient.utils.shared_memory as shm

    client, acme, beta = http_client(sluice), headers("acme"), headers("beta")
    secret, key = regions.create("secret", 128)
    shm.set_shared_memory_region(secret, [demo_x(5)])
    client.register_system_shared_memory("secret", key, 128, headers=acme)
    try:
        code, message = status_of(lambda: shm_infer(client, "secret", [2, 16], 128, headers=beta))
        assert code == "404"
        assert message == "no shared memory region 'secret' is registered by this tenant"
        assert client.get_system_shared_memory_status(headers=beta) == []
        code, _ = status_of(lambda: client.unregister_system_shared_memory("secret", headers=beta))
        assert code == "404"
        code, message = status_of(
            lambda: client.register_system_shared_memory("mine", key, 128, headers=beta)
        )
        assert (code, "registered by another tenant" in message) == ("400", True)
        # The other key of the same tenant sees it: regions belong to tenants.
        assert len(client.get_system_shared_memory_status(headers=headers("acme2"))) == 1
    finally:
        client.unregister_system_shared_memory(headers=acme)


def test_bad_offsets_symlinks_and_floods_are_4xx_and_leak_nothing(
    sluice: Any, regions: Regions
) -> None:
    import httpx

    client, acme = http_client(sluice), headers("acme")
    pid = sluice.process.pid
    before = open_regions(pid)
    _, key = regions.create("small", 128)
    link = SHM / f"sluice-test-{regions.tag}-link"
    link.symlink_to(SHM / key.lstrip("/"))
    try:
        for name, bad_key, size, offset in (
            ("past", key, 129, 0),
            ("offset", key, 8, 121),
            ("link", f"/{link.name}", 8, 0),
            ("escape", "/../etc/passwd", 8, 0),
        ):
            register = client.register_system_shared_memory
            code, _ = status_of(register, name, bad_key, size, offset, headers=acme)
            assert code == "400", name
        client.register_system_shared_memory("small", key, 128, headers=acme)
        code, message = status_of(
            lambda: shm_infer(client, "small", [2, 16], 128, offset=64, headers=acme)
        )
        assert code == "400"
        assert "128 bytes at shared_memory_offset 64 pass the end of region 'small'" in message
        code, message = status_of(lambda: shm_infer(client, "small", [4, 16], 256, headers=acme))
        assert code == "400"
        # Thousands of registrations: the bound holds, each past it a 400.
        codes: dict[int, int] = {}
        with httpx.Client(base_url=sluice.url, headers=acme, timeout=10) as http:
            for index in range(2000):
                response = http.post(
                    f"/v2/systemsharedmemory/region/flood{index}/register",
                    json={"key": key, "byte_size": 64},
                )
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
        assert codes == {200: MAX_REGIONS - 1, 400: 2000 - MAX_REGIONS + 1}
        assert open_regions(pid) == before + MAX_REGIONS
    finally:
        client.unregister_system_shared_memory(headers=acme)
        link.unlink()
    assert open_regions(pid) == before
    assert reference(sluice, demo_x(6)).shape == (2, 10)  # still serving


def test_a_region_shrunk_or_unlinked_under_load(sluice: Any, regions: Regions) -> None:
    import httpx

    acme = headers("acme")
    pid = sluice.process.pid
    before = open_regions(pid)
    x = demo_x(7, rows=64)
    handle, key = regions.create("load", x.nbytes)
    path = SHM / key.lstrip("/")
    path.write_bytes(x.tobytes())
    http_client(sluice).register_system_shared_memory("load", key, x.nbytes, headers=acme)
    params = {"shared_memory_region": "load", "shared_memory_byte_size": x.nbytes}
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [64, 16], "parameters": params}]}
    statuses: list[int] = []
    answered = threading.Condition()
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=sluice.url, headers=acme, timeout=30) as http:
            while not stop.is_set():
                status = http.post("/v2/models/demo/infer", json=body).status_code
                with answered:
                    statuses.append(status)
                    answered.notify_all()

    def after(more: int) -> None:
        """Wait until `more` further answers came (each may have raced the last change)."""
        with answered:
            target = len(statuses) + more
            assert answered.wait_for(lambda: len(statuses) >= target, timeout=60)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        after(10)
        for size in (x.nbytes // 2, 0, x.nbytes, 100, x.nbytes):
            os.truncate(path, size)  # the client shrinks (and regrows) its file
            after(10)
        path.unlink()  # the open file lives on; only its name is gone
        after(10)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert set(statuses) <= {200, 400}
    assert {200, 400} <= set(statuses)
    http_client(sluice).unregister_system_shared_memory(headers=acme)
    handle._mpsm_handle.close()
    regions.handles.remove(handle)
    assert open_regions(pid) == before
    assert reference(sluice, demo_x(8)).shape == (2, 10)  # still serving


def test_a_revoked_keys_regions_are_dropped(sluice: Any, regions: Regions, keys_file: Path) -> None:
    import time

    client = http_client(sluice)
    _, key = regions.create("revoked", 128)
    client.register_system_shared_memory("revoked", key, 128, headers=headers("acme2"))
    assert len(client.get_system_shared_memory_status(headers=headers("acme"))) == 1
    write_keys(keys_file, ["acme", "beta"])
    try:
        deadline = time.monotonic() + 10
        while client.get_system_shared_memory_status(headers=headers("acme")):
            assert time.monotonic() < deadline, "the revoked key's region was not dropped"
            time.sleep(0.05)
    finally:
        write_keys(keys_file, list(KEYS))


if __name__ == "__main__":
    if sys.argv[1] == "grpc":
        print(json.dumps(grpc_calls(*sys.argv[2:6])))
