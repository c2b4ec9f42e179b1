from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import Result

from converters.errors import ConversionError, MissingDependency
from converters.spec import parse_input
from converters.tensorrt import (
    build_engine,
    missing_requirements,
    optimization_profiles,
    require_tensorrt,
)
from engine.backends.tensorrt import TensorRTBackend
from engine.errors import BackendError
from engine.model_config import TensorRTOptions
from tests.fakes import tensorrt as fake_tensorrt
from tests.fakes.cuda_runtime import FakeCudaRuntime, cudaDeviceProp
from tests.fakes.install import install_cuda, install_tensorrt
from tests.models import identity_model
from tests.unit.converters.conftest import run_convert

MISSING = missing_requirements()


@pytest.mark.skipif(not MISSING, reason="this machine has TensorRT and a CUDA GPU")
def test_missing_tensorrt_or_gpu_is_named() -> None:
    with pytest.raises(MissingDependency) as caught:
        require_tensorrt()
    message = str(caught.value)
    assert message.startswith("--target tensorrt is not possible here: ")
    assert caught.value.missing == MISSING
    assert any("tensorrt package" in item or "CUDA GPU" in item for item in MISSING)


def test_one_profile_per_preferred_batch_size_bucket() -> None:
    spec = parse_input("ids:INT64:-1,sequence=128")
    # Preferred sizes above max_batch_size are dropped; the last bucket ends at max_batch_size.
    assert optimization_profiles([spec], 32, [16, 4, 64]) == [
        {"ids": ((1, 1), (4, 128), (4, 128))},
        {"ids": ((5, 1), (16, 128), (16, 128))},
        {"ids": ((17, 1), (32, 128), (32, 128))},
    ]
    assert optimization_profiles([spec], 8, []) == [{"ids": ((1, 1), (8, 128), (8, 128))}]
    assert optimization_profiles([spec], 8, [8]) == [{"ids": ((1, 1), (8, 128), (8, 128))}]


def test_profile_of_an_unbatched_input_is_its_shape() -> None:
    spec = parse_input("x:FP32:1,3,224,224")
    assert optimization_profiles([spec], 0, [4]) == [{"x": ((1, 3, 224, 224),) * 3}]


@pytest.mark.gpu
@pytest.mark.skipif(bool(MISSING), reason=f"needs TensorRT and a CUDA GPU: {'; '.join(MISSING)}")
def test_fp16_engine_matches_onnx_runtime() -> None:
    import numpy as np

    from converters.runners import OnnxRunner
    from converters.tensorrt import TensorRTRunner
    from tests.unit.converters.graphs import mlp

    model = mlp().SerializeToString()
    specs = [parse_input("x:FP32:-1,8")]
    build = build_engine(model, specs, 16, [8], "fp16", use_cache=False)
    assert len(build.record["profiles"]) == 2  # batch 1-8 and 9-16
    runner = TensorRTRunner(build.plan)
    for rows in (5, 12):  # one batch on each profile
        x = np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)
        [expected] = OnnxRunner(model).run({"x": x})
        [actual] = runner.run({"x": x})
        np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=2e-2)


# -- builds, the engine cache and the build record, against the fakes (tests/fakes) -------------


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeCudaRuntime:
    runtime = FakeCudaRuntime([cudaDeviceProp(b"NVIDIA H100 80GB HBM3", 9, 0)])
    install_cuda(monkeypatch, runtime)
    install_tensorrt(monkeypatch)
    monkeypatch.setenv("SLUICE_TENSORRT_CACHE", str(tmp_path / "engine-cache"))
    return runtime


def identity_onnx() -> bytes:
    return identity_model("FP32", ("batch", 4), "x", "y").SerializeToString()


def test_a_build_records_what_the_engine_is_for(fakes: FakeCudaRuntime) -> None:
    build = build_engine(identity_onnx(), [parse_input("x:FP32:-1,4")], 16, [8], "fp16")
    assert build.record == {
        "version": "10.3.0",
        "gpu": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0",
        "hardware_compatibility": "none",
        "precision": "fp16",
        "profiles": [
            {"x": {"min": [1, 4], "opt": [8, 4], "max": [8, 4]}},
            {"x": {"min": [9, 4], "opt": [16, 4], "max": [16, 4]}},
        ],
        "builder_workspace_bytes": 1 << 30,
        "cache_key": build.record["cache_key"],
        "engine_cache": os.environ["SLUICE_TENSORRT_CACHE"],
        "cached": False,
    }
    [config] = fake_tensorrt.configs
    assert config.pool_limits == {fake_tensorrt.MemoryPoolType.WORKSPACE: 1 << 30}
    assert [p.shapes for p in config.profiles] == [
        {"x": [[1, 4], [8, 4], [8, 4]]},
        {"x": [[9, 4], [16, 4], [16, 4]]},
    ]


def test_the_engine_cache_skips_rebuilds_of_the_same_build(
    fakes: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [parse_input("x:FP32:-1,4")]
    builds = fake_tensorrt.Builder.builds
    first = build_engine(identity_onnx(), specs, 16, [8], "fp16")
    again = build_engine(identity_onnx(), specs, 16, [8], "fp16")
    assert (again.plan, again.record["cached"]) == (first.plan, True)
    assert fake_tensorrt.Builder.builds == builds + 1
    others = [
        build_engine(identity_onnx(), specs, 16, [8], "fp32"),  # precision
        build_engine(identity_onnx(), specs, 32, [8], "fp16"),  # profile
        build_engine(identity_onnx(), specs, 16, [8], "fp16", builder_workspace_bytes=1 << 20),
    ]
    monkeypatch.setattr(fake_tensorrt, "__version__", "10.4.0")
    others.append(build_engine(identity_onnx(), specs, 16, [8], "fp16"))  # TensorRT version
    assert [o.record["cached"] for o in others] == [False] * 4
    assert len({first.record["cache_key"], *(o.record["cache_key"] for o in others)}) == 5


def test_the_engine_cache_keys_on_the_gpu_model_unless_a_compatibility_level_allows_more(
    fakes: FakeCudaRuntime,
) -> None:
    # NVIDIA ties a plan to the GPU model, not only its compute capability: an H100 PCIe must not
    # take the engine an H100 SXM built (TensorRT itself would only log a warning).
    specs = [parse_input("x:FP32:-1,4")]
    sxm = build_engine(identity_onnx(), specs, 8, [], "fp16")
    fakes.devices[0] = cudaDeviceProp(b"NVIDIA H100 PCIe", 9, 0)
    pcie = build_engine(identity_onnx(), specs, 8, [], "fp16")
    assert (pcie.record["cached"], pcie.record["cache_key"] != sxm.record["cache_key"]) == (
        False,
        True,
    )
    # With a hardware compatibility level the engine runs on every GPU the level names, so one
    # build serves them all: same_compute_capability keys on 9.0, ampere_plus on neither.
    same = build_engine(identity_onnx(), specs, 8, [], "fp16", hardware_compatibility="ampere_plus")
    fakes.devices[0] = cudaDeviceProp(b"NVIDIA A100-SXM4-80GB", 8, 0)
    again = build_engine(
        identity_onnx(), specs, 8, [], "fp16", hardware_compatibility="ampere_plus"
    )
    assert (again.record["cached"], again.plan) == (True, same.plan)
    assert fake_tensorrt.configs[-1].hardware_compatibility_level == (
        fake_tensorrt.HardwareCompatibilityLevel.AMPERE_PLUS
    )
    level = "same_compute_capability"
    on_a100 = build_engine(identity_onnx(), specs, 8, [], "fp16", hardware_compatibility=level)
    fakes.devices[0] = cudaDeviceProp(b"NVIDIA A100-PCIE-40GB", 8, 0)
    assert (
        build_engine(identity_onnx(), specs, 8, [], "fp16", hardware_compatibility=level).record[
            "cache_key"
        ]
        == (on_a100.record["cache_key"])
    )
    fakes.devices[0] = cudaDeviceProp(b"NVIDIA L4", 8, 9)
    assert (
        build_engine(identity_onnx(), specs, 8, [], "fp16", hardware_compatibility=level).record[
            "cache_key"
        ]
        != (on_a100.record["cache_key"])
    )


def test_an_engine_for_another_model_of_the_same_compute_capability_is_refused(
    fakes: FakeCudaRuntime, tmp_path: Path
) -> None:
    result, _ = convert_identity(tmp_path)
    assert result.exit_code == 0, result.output
    plan = tmp_path / "repo" / "ident" / "1" / "model.plan"
    fakes.devices[0] = cudaDeviceProp(b"NVIDIA H100 PCIe", 9, 0)  # same 9.0, another model
    with pytest.raises(BackendError) as caught:
        TensorRTBackend(plan, TensorRTOptions(), "model 'ident' version 1")
    assert str(caught.value).startswith(
        f"{plan} was built with TensorRT 10.3.0 for NVIDIA H100 80GB HBM3 (compute capability "
        "9.0); this machine has TensorRT 10.3.0 and NVIDIA H100 PCIe (compute capability 9.0): "
        "this engine runs only with TensorRT 10.3.0 on the GPU model that built it, NVIDIA H100 "
        "80GB HBM3, so rebuild it here with `sluice convert"
    )


@pytest.mark.parametrize(
    ("level", "elsewhere", "loads"),
    [
        ("same_compute_capability", (b"NVIDIA H100 PCIe", 9, 0), True),
        ("same_compute_capability", (b"NVIDIA A100-SXM4-80GB", 8, 0), False),
        ("ampere_plus", (b"NVIDIA A100-SXM4-80GB", 8, 0), True),
        ("ampere_plus", (b"Tesla T4", 7, 5), False),
    ],
)
def test_a_hardware_compatible_engine_loads_where_its_level_allows(
    fakes: FakeCudaRuntime,
    tmp_path: Path,
    level: str,
    elsewhere: tuple[bytes, int, int],
    loads: bool,
) -> None:
    result, record = convert_identity(tmp_path, "--hardware-compatibility", level)
    assert result.exit_code == 0, result.output
    assert record["hardware_compatibility"] == level
    plan = tmp_path / "repo" / "ident" / "1" / "model.plan"
    fakes.devices[0] = cudaDeviceProp(*elsewhere)
    if loads:
        backend = TensorRTBackend(plan, TensorRTOptions(), "model 'ident' version 1")
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(backend.run({"x": x})["y"], x)
        backend.close()
        return
    with pytest.raises(
        BackendError, match=f"on .*\\(hardware compatibility {level}\\), so rebuild"
    ):
        TensorRTBackend(plan, TensorRTOptions(), "model 'ident' version 1")


def test_convert_publishes_an_engine_the_server_loads_and_checks(
    fakes: FakeCudaRuntime, tmp_path: Path
) -> None:
    source = tmp_path / "identity.onnx"
    source.write_bytes(identity_onnx())
    repository = tmp_path / "repo"
    result = run_convert(
        source, "--target", "tensorrt", "--precision", "fp16", "--max-batch-size", "8",
        "--measure-iterations", "0", "--repository", repository, "--name", "ident",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((repository / "ident" / "1" / "conversion.json").read_text())
    assert record["validated_on"] == "TensorRT 10.3.0 on NVIDIA H100 80GB HBM3"
    assert record["validation"]["passed"] is True
    assert (record["tensorrt"]["version"], record["tensorrt"]["compute_capability"]) == (
        "10.3.0",
        "9.0",
    )
    plan = repository / "ident" / "1" / "model.plan"
    backend = TensorRTBackend(plan, TensorRTOptions(), "model 'ident' version 1")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(backend.run({"x": x})["y"], x)
    backend.close()
    fakes.devices[0] = cudaDeviceProp(b"NVIDIA A100-SXM4-80GB", 8, 0)  # the same files, elsewhere
    with pytest.raises(BackendError) as caught:
        TensorRTBackend(plan, TensorRTOptions(), "model 'ident' version 1")
    assert "built with TensorRT 10.3.0 for NVIDIA H100 80GB HBM3 (compute capability 9.0)" in str(
        caught.value
    )
    assert (
        "this machine has TensorRT 10.3.0 and NVIDIA A100-SXM4-80GB (compute capability 8.0)"
        in (str(caught.value))
    )


def test_the_validation_runner_frees_its_gpu_memory(fakes: FakeCudaRuntime, tmp_path: Path) -> None:
    from converters.tensorrt import TensorRTRunner

    build = build_engine(identity_onnx(), [parse_input("x:FP32:-1,4")], 8, [], "fp32")
    runner = TensorRTRunner(build.plan)
    x = np.ones((2, 4), dtype=np.float32)
    np.testing.assert_array_equal(runner.run({"x": x})[0], x)
    assert (fakes.live_device_allocations, fakes.live_streams) != (0, 0)
    runner.close()
    runner.close()  # a second close is a no-op
    held = (fakes.live_device_allocations, fakes.live_pinned_allocations, fakes.live_streams)
    assert held == (0, 0, 0)
    # And `sluice convert` closes the runner it validated and measured with.
    result, _ = convert_identity(tmp_path, "--measure-iterations", "2")
    assert result.exit_code == 0, result.output
    held = (fakes.live_device_allocations, fakes.live_pinned_allocations, fakes.live_streams)
    assert held == (0, 0, 0)


def test_a_profile_tensorrt_refuses_fails_the_build(fakes: FakeCudaRuntime) -> None:
    # add_optimization_profile answers -1 for a profile it does not take; building on would
    # make an engine without it (or none, with a bare None from the builder).
    fake_tensorrt.refuse.add("add_optimization_profile")
    with pytest.raises(ConversionError, match=r"TensorRT refused optimization profile 0 \{"):
        build_engine(identity_onnx(), [parse_input("x:FP32:-1,4")], 16, [8], "fp16")


def test_an_explicit_engine_cache_folder_or_none(fakes: FakeCudaRuntime, tmp_path: Path) -> None:
    specs = [parse_input("x:FP32:-1,4")]
    folder = tmp_path / "explicit"
    first = build_engine(identity_onnx(), specs, 8, [], "fp32", cache=folder)
    assert first.record["engine_cache"] == str(folder)
    assert [p.name for p in folder.iterdir()] == [f"{first.record['cache_key']}.plan"]
    assert build_engine(identity_onnx(), specs, 8, [], "fp32", cache=folder).record["cached"]
    builds = fake_tensorrt.Builder.builds
    uncached = build_engine(identity_onnx(), specs, 8, [], "fp32", cache=folder, use_cache=False)
    assert (uncached.record["cached"], uncached.record["engine_cache"]) == (False, None)
    assert fake_tensorrt.Builder.builds == builds + 1  # rebuilt although the cache has it
    assert not (tmp_path / "engine-cache").exists()  # $SLUICE_TENSORRT_CACHE was never used


def convert_identity(tmp_path: Path, *args: str | Path) -> tuple[Result, dict[str, Any]]:
    source = tmp_path / "identity.onnx"
    source.write_bytes(identity_onnx())
    repository = tmp_path / "repo"
    result = run_convert(
        source, "--target", "tensorrt", "--max-batch-size", "8", "--measure-iterations", "0",
        "--repository", repository, "--name", "ident", "--replace-config", *args,
    )  # fmt: skip
    if result.exit_code != 0:
        return result, {}
    versions = sorted((repository / "ident").glob("[0-9]*"), key=lambda p: int(p.name))
    return result, json.loads((versions[-1] / "conversion.json").read_text())["tensorrt"]


def test_workspace_and_engine_cache_options_reach_the_build_and_its_record(
    fakes: FakeCudaRuntime, tmp_path: Path
) -> None:
    folder = tmp_path / "my-cache"
    result, record = convert_identity(
        tmp_path, "--workspace", "268435456", "--engine-cache", folder
    )
    assert result.exit_code == 0, result.output
    assert (record["builder_workspace_bytes"], record["engine_cache"]) == (1 << 28, str(folder))
    assert fake_tensorrt.configs[-1].pool_limits[fake_tensorrt.MemoryPoolType.WORKSPACE] == 1 << 28
    assert (folder / f"{record['cache_key']}.plan").is_file()
    assert not (tmp_path / "engine-cache").exists()  # --engine-cache overrides the environment
    result, again = convert_identity(tmp_path, "--workspace", "268435456", "--engine-cache", folder)
    assert (result.exit_code, again["cached"]) == (0, True), result.output
    result, off = convert_identity(tmp_path, "--workspace", "268435456", "--no-engine-cache")
    assert (result.exit_code, off["cached"], off["engine_cache"]) == (0, False, None)
    assert not (tmp_path / "engine-cache").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--builder-workspace", "0"],
            "Invalid value for '--builder-workspace' / '--workspace': 0 is not a positive number "
            "of bytes",
        ),
        (
            ["--workspace", "1GiB"],
            "Invalid value for '--builder-workspace' / '--workspace': '1GiB' is not a number of "
            "bytes (give an integer: 1073741824 is 1 GiB)",
        ),
        (
            ["--engine-cache", "DIR", "--no-engine-cache"],
            "--engine-cache DIR and --no-engine-cache contradict each other: give one",
        ),
        (["--engine-cache", "FILE"], "Directory"),
    ],
)
def test_tensorrt_option_usage_errors_exit_2(
    fakes: FakeCudaRuntime, tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "FILE").write_text("not a folder")
    args = [str(tmp_path / a) if a in ("DIR", "FILE") else a for a in args]
    result, _ = convert_identity(tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert message.replace("DIR", str(tmp_path / "DIR")) in " ".join(result.output.split())
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--builder-workspace", "1024"],
        ["--hardware-compatibility", "ampere_plus"],
        ["--engine-cache", "c"],
        ["--no-engine-cache"],
    ],
)
def test_tensorrt_options_without_target_tensorrt_exit_2(tmp_path: Path, args: list[str]) -> None:
    source = tmp_path / "identity.onnx"
    source.write_bytes(identity_onnx())
    result = run_convert(source, "--repository", tmp_path / "repo", *args)
    assert result.exit_code == 2, result.output
    assert f"{args[0]} is used only with --target tensorrt (the target is onnxruntime)" in (
        " ".join(result.output.split())
    )


@pytest.mark.gpu
@pytest.mark.skipif(bool(MISSING), reason=f"needs TensorRT and a CUDA GPU: {'; '.join(MISSING)}")
def test_real_convert_with_profiles_workspace_and_engine_cache(tmp_path: Path) -> None:
    """Real TensorRT: two profiles built under a given workspace into a given cache, rebuilt
    from that cache, then served by two instances on GPU 0 (an engine each) on both profiles."""
    from engine.model_config import InstanceGroup

    args = ["--precision", "fp16", "--preferred-batch-size", "4", "--workspace", str(1 << 28)]
    args += ["--engine-cache", str(tmp_path / "engines")]
    result, record = convert_identity(tmp_path, *args)
    assert result.exit_code == 0, result.output
    assert (record["builder_workspace_bytes"], record["cached"], len(record["profiles"])) == (
        1 << 28,
        False,
        2,
    )
    result, again = convert_identity(tmp_path, *args)
    assert (result.exit_code, again["cached"]) == (0, True), result.output
    plan = tmp_path / "repo" / "ident" / "2" / "model.plan"
    groups = [InstanceGroup(count=2, kind="gpu", gpus=[0])]
    backend = TensorRTBackend(plan, TensorRTOptions(), "model 'ident' version 2", groups)
    try:
        for rows in (3, 7, 4, 8):  # profile 0 (1-4) and profile 1 (5-8)
            x = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
            np.testing.assert_allclose(backend.run({"x": x})["y"], x, rtol=1e-3, atol=1e-3)
    finally:
        backend.close()


def test_no_loadable_cuda_driver_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    install_cuda(monkeypatch, FakeCudaRuntime(driver=False))
    install_tensorrt(monkeypatch)
    assert missing_requirements() == [
        "no CUDA GPU (the CUDA driver does not load: Failed to dlopen libcuda.so.1)"
    ]
