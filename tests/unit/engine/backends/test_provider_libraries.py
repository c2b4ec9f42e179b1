"""engine.backends.provider_libraries: Dockerfile.gpu's build-time check (ldd's verdicts read
right: the output below is ldd's, verbatim, on onnxruntime-gpu 1.26.0's TensorRT provider with
no CUDA or TensorRT libraries on the path; a real library resolved; the CPU build named), and
the run-time preload of the tensorrt wheels' libraries, on a stand-in tensorrt_libs folder
holding a real shared library."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest

from engine.backends.provider_libraries import (
    not_found,
    preload_tensorrt,
    problems,
    unresolved,
)

LDD_TENSORRT_PROVIDER = """\
\tlinux-vdso.so.1 (0x00007fc25f853000)
\tlibcublas.so.12 => not found
\tlibdl.so.2 => /lib/x86_64-linux-gnu/libdl.so.2 (0x00007fc25f781000)
\tlibnvinfer.so.10 => not found
\tlibnvonnxparser.so.10 => not found
\tlibcudart.so.12 => not found
\tlibcudnn.so.9 => not found
\tlibrt.so.1 => /lib/x86_64-linux-gnu/librt.so.1 (0x00007fc25f77a000)
\tlibstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x00007fc25f400000)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007fc25f21e000)
\t/lib64/ld-linux-x86-64.so.2 (0x00007fc25f855000)
"""


def test_ldd_reports_what_the_loader_cannot_find() -> None:
    assert not_found(LDD_TENSORRT_PROVIDER) == [
        "libcublas.so.12",
        "libnvinfer.so.10",
        "libnvonnxparser.so.10",
        "libcudart.so.12",
        "libcudnn.so.9",
    ]


def test_the_driver_library_is_expected_missing_at_build_time() -> None:
    output = "\tlibcuda.so.1 => not found\n\tlibnvinfer.so.10 => not found\n"
    assert not_found(output) == ["libnvinfer.so.10"]


CAPI = Path(ort.__file__).parent / "capi"


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd (glibc)")
def test_a_library_whose_dependencies_resolve_has_none_missing() -> None:
    [library] = CAPI.glob("libonnxruntime_providers_shared.so")
    assert unresolved(library) == []
    with pytest.raises(OSError, match=r"ldd .* failed"):
        unresolved(CAPI / "__init__.py")  # not a dynamic executable


def test_a_cpu_onnxruntime_is_named() -> None:
    assert problems(CAPI, ["CPUExecutionProvider"]) == [
        "CUDAExecutionProvider is not compiled into this onnxruntime (the CPU build?)",
        "TensorrtExecutionProvider is not compiled into this onnxruntime (the CPU build?)",
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_libs") is not None, reason="the tensorrt wheels are here"
)
def test_without_the_tensorrt_wheels_nothing_is_preloaded() -> None:
    assert preload_tensorrt() == []


def test_tensorrt_libraries_are_loaded_into_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A stand-in for site-packages/tensorrt_libs: a real shared library under libnvinfer's name,
    # and a damaged one under libnvonnxparser's.
    folder = tmp_path / "tensorrt_libs"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    nvinfer = folder / "libnvinfer.so.10"
    shutil.copy(CAPI / "libonnxruntime_providers_shared.so", nvinfer)
    (folder / "libnvonnxparser.so.10").write_text("not an ELF file")
    (folder / "libnvinfer_builder_resource.so.10.9.0").write_text("never loaded: not needed")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="sluice.backend.onnxruntime"):
        assert preload_tensorrt() == [nvinfer]
    assert str(nvinfer) in Path("/proc/self/maps").read_text()
    [warning] = caplog.records
    assert warning.getMessage().startswith(
        f"could not load {folder / 'libnvonnxparser.so.10'} (TensorRT's provider may not start)"
    )
