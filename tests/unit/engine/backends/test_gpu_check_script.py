"""scripts/gpu-check.sh on this CPU-only machine: every GPU check skips and says why; and with
cuda-python and pynvml stood in by the fakes (a shim on PYTHONPATH, the way a real install
would be found) the same script runs its CUDA checks and the gpu-marked tests, and passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.fakes.install import write_shims

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def run_script(tmp_path: Path, pythonpath: Path | None = None) -> tuple[int, str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_CHECK_LOGS": str(tmp_path / "logs"),
    }
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr


def summary(output: str) -> list[str]:
    return output.split("== summary")[1].splitlines()[1:]


def test_without_cuda_every_check_skips_with_its_reason(tmp_path: Path) -> None:
    rc, output = run_script(tmp_path)
    assert rc == 0, output
    lines = summary(output)
    assert (
        "SKIP  cuda-python: cuda-python is not installed (pip install 'cuda-python>=12.6.1,<13')"
        in lines
    )
    assert "SKIP  nvml: nvidia-ml-py (pynvml) is not installed" in lines
    assert (
        "SKIP  tensorrt: the tensorrt package is not installed (pip install 'sluice[gpu]' "
        "--extra-index-url https://pypi.nvidia.com)" in lines
    )
    assert "SKIP  gpu-tests: every gpu-marked test skipped (reasons above)" in lines
    assert "PASS  python-deps: sluice's Python dependencies import" in lines
    skipped = [line for line in output.splitlines() if line.startswith("SKIPPED [1] ")]
    assert any(
        "test_cuda.py" in line and "cuda-python is not installed" in line for line in skipped
    )


def test_with_cuda_python_present_the_cuda_checks_run(tmp_path: Path) -> None:
    rc, output = run_script(tmp_path, pythonpath=write_shims(tmp_path / "site", tensorrt=False))
    assert rc == 0, output
    lines = summary(output)
    cuda = next(line for line in lines if "cuda-python:" in line)
    assert cuda.startswith(
        "PASS  cuda-python: 1 GPU(s); GPU 0 NVIDIA Fake GPU (compute capability 9.0)"
    )
    assert "PASS  nvml: GPU 0 NVIDIA Fake GPU: 40% busy, 1024 of 81920 MiB used" in lines
    assert any(line.startswith("PASS  gpu-tests: ") for line in lines), output
    assert any(line.startswith("SKIP  tensorrt: the tensorrt package") for line in lines)
    passed = [line for line in output.splitlines() if line.startswith("PASSED ")]
    assert any("test_real_cuda_buffers_and_streams_under_a_fake_engine" in line for line in passed)
    assert sum("test_cuda.py" in line and "[real]" in line for line in passed) == 6


def test_the_cuda_check_holds_across_cuda_python_releases(tmp_path: Path) -> None:
    # cuda-python 12.9 takes ints where 12.6 takes only enums, and 12.6 raises RuntimeError
    # where 12.9 answers cudaErrorInsufficientDriver: the script passes or skips on either.
    rc, output = run_script(tmp_path, write_shims(tmp_path / "a", tensorrt=False, int_enums=True))
    assert rc == 0, output
    assert any(line.startswith("PASS  cuda-python: 1 GPU(s)") for line in summary(output)), output
    rc, output = run_script(tmp_path, write_shims(tmp_path / "b", tensorrt=False, driver=False))
    assert rc == 0, output
    assert (
        "SKIP  cuda-python: cuda-python sees no CUDA device (the CUDA driver does not load: "
        "Failed to dlopen libcuda.so.1)" in summary(output)
    ), output
