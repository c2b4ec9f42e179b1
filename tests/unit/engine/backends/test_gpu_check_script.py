"""scripts/gpu-check.sh on this CPU-only machine: every GPU check skips and says why (and the
summary lists what could not be checked); with cuda-python and pynvml stood in by the fakes (a
shim on PYTHONPATH, the way a real install would be found) the same script runs its CUDA checks
and the gpu-marked tests, and passes; a bare host's offline venv is made from a wheelhouse;
scripts/gpu-wheelhouse.sh refuses a wheelhouse over 64 MiB; shellcheck passes both."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.fakes.install import write_shims
from tests.unit.deploy.tools import tool

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
WHEELHOUSE_SCRIPT = ROOT / "scripts" / "gpu-wheelhouse.sh"


def run_script(tmp_path: Path, pythonpath: Path | None = None, **extra: str) -> tuple[int, str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_CHECK_LOGS": str(tmp_path / "logs"),
        **extra,
    }
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr


def summary(output: str) -> list[str]:
    return output.split("== summary")[1].split("\n\n")[0].splitlines()[1:]


def not_checked(output: str) -> list[str]:
    return output.split("== not checked on this machine")[1].splitlines()[1:]


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
    assert (
        "SKIP  cupy: cupy is not installed (its gpu-marked tests skip: real kernels on sluice's "
        "streams)" in lines
    )
    assert any(
        line.startswith("SKIP  onnxruntime-gpu: this onnxruntime is a CPU build") for line in lines
    )
    assert not_checked(output) == [line[6:] for line in lines if line.startswith("SKIP  ")]
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


@pytest.mark.parametrize("script", [SCRIPT, WHEELHOUSE_SCRIPT], ids=lambda path: path.name)
def test_shellcheck_finds_nothing(script: Path) -> None:
    result = subprocess.run(
        [tool("shellcheck"), str(script)], capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def write_wheel(folder: Path, name: str, module: str) -> Path:
    """A minimal pure-Python wheel (what `pip wheel` makes for one module), built by hand so no
    build backend or network is needed."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": module.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(data)},{len(data)}\n" for path, data in files.items())
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in files.items():
            wheel.writestr(member, data)
        wheel.writestr(f"{dist}/RECORD", record + f"{dist}/RECORD,,\n")
    return path


def test_a_bare_host_gets_an_offline_venv_from_the_wheelhouse(tmp_path: Path) -> None:
    write_wheel(tmp_path / "wheelhouse", "sluice_probe", "ANSWER = 42\n")
    requirements = tmp_path / "wheels.txt"
    requirements.write_text("# as scripts/gpu-check-wheels.txt lists them\nsluice-probe\n")
    venv = tmp_path / "venv"
    rc, output = run_script(
        tmp_path,
        GPU_CHECK_WHEELHOUSE=str(tmp_path / "wheelhouse"),
        GPU_CHECK_REQUIREMENTS=str(requirements),
        GPU_CHECK_VENV=str(venv),
    )
    assert f"sluice GPU check: python {venv}/bin/python" in output
    assert any(
        line.startswith("PASS  wheelhouse: ") and f"venv {venv}, installed offline from" in line
        for line in summary(output)
    ), output
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sluice_probe; print(sluice_probe.ANSWER)"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert probe.stdout.strip() == "42", probe.stderr
    requirements.write_text("sluice-probe\nnot-in-the-wheelhouse\n")
    rc, output = run_script(
        tmp_path,
        GPU_CHECK_WHEELHOUSE=str(tmp_path / "wheelhouse"),
        GPU_CHECK_REQUIREMENTS=str(requirements),
        GPU_CHECK_VENV=str(tmp_path / "venv2"),
    )
    assert rc == 1
    wheelhouse = next(line for line in summary(output) if "wheelhouse:" in line)
    assert wheelhouse.startswith("FAIL  wheelhouse: ")
    assert "not-in-the-wheelhouse" in wheelhouse


def test_the_wheelhouse_script_refuses_more_than_64_mib(tmp_path: Path) -> None:
    # A stand-in pip that "downloads" one sparse 65 MiB wheel into --dest.
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\nwhile (($#)); do [[ $1 == --dest ]] && dest=$2; shift; done\n"
        'truncate -s 65M "$dest/big-1.0-py3-none-any.whl"\n'
    )
    fake.chmod(0o755)
    result = subprocess.run(
        ["bash", str(WHEELHOUSE_SCRIPT), str(tmp_path / "wh")],
        env={"PATH": os.environ["PATH"], "PYTHON": str(fake)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stdout == f"1 wheels, 65 MiB in {tmp_path / 'wh'}\n"
    assert "the wheelhouse is over 64 MiB" in result.stderr
