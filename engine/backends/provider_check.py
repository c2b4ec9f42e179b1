"""`python -m engine.backends.provider_check`: on a machine with a GPU, prove that ONNX Runtime's
TensorRT and CUDA providers load, take nodes and compute what the CPU computes.

What `Dockerfile.gpu`'s build can check without a GPU stops at the libraries: the providers are
compiled in and their shared libraries resolve (libnvinfer, cuDNN, cuBLAS). Whether a session
really runs on TensorRT needs the GPU and its driver, so it is checked here, on the demo MLP:
a session per provider (TensorRT with CUDA and CPU behind it, as a model config lists them),
`require_providers`' own check (created, and running at least one node), one batch compared
with the CPU provider's answer. Run it once per host or image:

    docker run --rm --gpus all sluice:0.1.0-gpu python -m engine.backends.provider_check

Prints one line per provider (PASS, or FAIL with the reason) and exits 1 if any failed; 77 (a
skip, for scripts/gpu-check.sh) when this onnxruntime is the CPU build."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from engine.backends.base import CPU_PROVIDER
from engine.backends.placement import RECORD_PLACEMENT, check_required, describe, node_placement
from engine.backends.provider_libraries import preload_tensorrt
from engine.demo import mlp_model
from engine.errors import BackendError

TENSORRT, CUDA = "TensorrtExecutionProvider", "CUDAExecutionProvider"
SKIP = 77


def check(model: Path, provider: str, device: int) -> str:
    """One session on `provider` (the providers after it in TensorRT, CUDA, CPU behind it): a
    summary line, or BackendError saying what failed."""
    chain = [TENSORRT, CUDA][[TENSORRT, CUDA].index(provider) :]
    providers: list[str | tuple[str, dict[str, str]]] = [
        (name, {"device_id": str(device)}) for name in chain
    ]
    providers.append(CPU_PROVIDER)
    options = ort.SessionOptions()
    options.add_session_config_entry(RECORD_PLACEMENT, "1")
    session = ort.InferenceSession(str(model), options, providers=providers)
    check_required("the check's model", provider, session, ort.get_available_providers())
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    [got] = session.run(["probabilities"], {"x": x})
    cpu = ort.InferenceSession(str(model), providers=[CPU_PROVIDER])
    [expected] = cpu.run(["probabilities"], {"x": x})
    error = float(np.max(np.abs(np.asarray(got) - expected)))
    if not error <= 1e-3:  # TensorRT may use TF32 for the Gemms; a wrong answer is far off
        raise BackendError(f"{provider} answered {error:.2g} away from the CPU provider")
    placement = describe(node_placement(session) or {})
    return f"{provider} on GPU {device}: {placement}; matches CPU within {error:.1g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.backends.provider_check")
    parser.add_argument(
        "--provider", action="append", choices=[TENSORRT, CUDA], help="default: both"
    )
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal [0]")
    args = parser.parse_args(argv)
    available = ort.get_available_providers()
    if CUDA not in available:
        have = ", ".join(available)
        print(f"this onnxruntime is a CPU build (it has {have}): the `gpu` extra replaces it")
        return SKIP
    preload_tensorrt()  # as the server does before a session that lists TensorRT
    failed = False
    with tempfile.TemporaryDirectory(prefix="sluice-provider-check-") as folder:
        model = Path(folder) / "model.onnx"
        model.write_bytes(mlp_model().SerializeToString())
        for provider in args.provider or [TENSORRT, CUDA]:
            try:
                print(f"PASS  {check(model, provider, args.device)}")
            except BackendError as exc:
                failed = True
                print(f"FAIL  {provider}: {exc}")
            except Exception as exc:  # onnxruntime's own errors (Fail, EPFail, ...): report all
                failed = True
                print(f"FAIL  {provider}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
