"""`python -m engine.backends.provider_libraries`: the check `Dockerfile.gpu`'s build runs, where
there is no GPU: ONNX Runtime's GPU providers are compiled in, and their shared libraries load.

`ort.get_available_providers()` lists the providers compiled into onnxruntime, not those that
can load: ONNX Runtime opens `libonnxruntime_providers_tensorrt.so` only when a session asks
for TensorRT, and where the dynamic loader cannot find a library it links (libnvinfer.so.10
from the tensorrt wheels is on no library path unless the image puts it there) the provider
fails to start and the session falls back to CUDA with nothing but a log line. So each
provider library's dependencies are resolved here as the loader would at run time (`ldd`, under
this process's LD_LIBRARY_PATH). `libcuda.so.1` is the driver's, mounted into the container at
run time (NVIDIA Container Toolkit), so its absence here is expected. Whether a session then
really runs on the GPU needs one: `python -m engine.backends.provider_check`.

`preload_tensorrt()` is the run-time half, for installs without the image's LD_LIBRARY_PATH (a
pip install, a bundle, systemd): the ONNX Runtime backend calls it before opening a session
that lists TensorRT, so the provider's `libnvinfer.so.10` is already loaded when ONNX Runtime
opens the provider (the loader matches a needed library to a loaded one by its soname)."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("sluice.backend.onnxruntime")

DRIVER_LIBRARIES = frozenset({"libcuda.so.1", "libnvidia-ml.so.1"})
"""Libraries the NVIDIA driver provides at run time; not expected in an image."""

PROVIDERS = {
    "CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
    "TensorrtExecutionProvider": "libonnxruntime_providers_tensorrt.so",
}
"""Each GPU provider and the shared library ONNX Runtime loads for it (from onnxruntime/capi)."""


def not_found(ldd_output: str) -> list[str]:
    """The libraries that ldd's output reports `=> not found`, in order, less the driver's."""
    missing = []
    for line in ldd_output.splitlines():
        name, arrow, where = line.strip().partition(" => ")
        if arrow and where.strip() == "not found" and name not in DRIVER_LIBRARIES:
            missing.append(name)
    return missing


def unresolved(library: Path) -> list[str]:
    """What `library` needs, directly or through its dependencies, that the loader cannot
    find; raises OSError when ldd cannot read it."""
    result = subprocess.run(
        ["ldd", str(library)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise OSError(f"ldd {library} failed: {(result.stderr or result.stdout).strip()}")
    return not_found(result.stdout)


def problems(capi: Path, available: list[str]) -> list[str]:
    """Everything that keeps a GPU provider of the onnxruntime in `capi` from loading."""
    found = []
    for provider, filename in PROVIDERS.items():
        if provider not in available:
            found.append(f"{provider} is not compiled into this onnxruntime (the CPU build?)")
            continue
        library = capi / filename
        if not library.is_file():
            found.append(f"{provider}: {library} is missing")
            continue
        missing = unresolved(library)
        if missing:
            found.append(
                f"{provider}: {filename} cannot load: {', '.join(missing)} not found on the "
                "library path (LD_LIBRARY_PATH or ldconfig)"
            )
    return found


TENSORRT_LIBRARIES = ("libnvinfer.so.*", "libnvinfer_plugin.so.*", "libnvonnxparser.so.*")
"""What ONNX Runtime's TensorRT provider links (libnvinfer, libnvonnxparser) or opens by name
(the plugins), in the order they depend on each other."""


def preload_tensorrt() -> list[Path]:
    """Load the tensorrt wheels' libraries that ONNX Runtime's TensorRT provider needs
    (site-packages/tensorrt_libs) into this process; the ones loaded, none where that folder is
    absent. A library that does not load is logged, not raised: the provider then fails to
    start, and `require_providers` (or the load's log line) says so."""
    spec = importlib.util.find_spec("tensorrt_libs")
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(next(iter(spec.submodule_search_locations)))
    loaded = []
    for pattern in TENSORRT_LIBRARIES:
        for library in sorted(folder.glob(pattern)):
            try:
                ctypes.CDLL(str(library))
            except OSError as exc:
                log.warning(
                    "could not load %s (TensorRT's provider may not start): %s", library, exc
                )
                continue
            loaded.append(library)
    return loaded


def main() -> int:
    import onnxruntime as ort

    capi = Path(ort.__file__).parent / "capi"
    found = problems(capi, ort.get_available_providers())
    for problem in found:
        print(problem, file=sys.stderr)
    if not found:
        print(f"onnxruntime {ort.__version__}: {', '.join(PROVIDERS)} libraries resolve")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
