#!/usr/bin/env bash
# shellcheck disable=SC2329  # the check functions are invoked by name, through `check`
# The GPU checks of sluice in one command, for a machine with an NVIDIA GPU:
#
#     bash scripts/gpu-check.sh            # PYTHON=/path/to/python to choose the interpreter
#
# Runs what CPU-only CI cannot: cuda-python's real runtime under the native TensorRT backend's
# buffer and stream code (even where TensorRT itself is absent: a fake engine then drives real
# device buffers and streams, and with cupy its kernels are real), TensorRT builds (several
# optimization profiles, --builder-workspace, --engine-cache) and serving (a context per
# profile, an engine per instance), ONNX Runtime's TensorRT and CUDA providers, NVML.
#
# A bare GPU host (Python 3.12 with numpy, torch, cupy and cuda-bindings; no network; no
# onnxruntime-gpu or TensorRT) gets sluice's other dependencies from a wheelhouse built
# elsewhere with `bash scripts/gpu-wheelhouse.sh DIR` (under 64 MiB):
#
#     GPU_CHECK_WHEELHOUSE=DIR bash scripts/gpu-check.sh
#
# which makes a venv from python3.12 (or $PYTHON) with the system's packages visible and
# installs scripts/gpu-check-wheels.txt from DIR only, before the checks run in it.
# Every step has a timeout and the whole run stays under 10 minutes. It prints one line per
# check (PASS, SKIP with the reason, FAIL) and every gpu-marked test's outcome, then a summary
# and what could not be checked on this machine; the exit status is 1 when anything failed,
# else 0. Logs: $GPU_CHECK_LOGS (default a temp dir).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

logs=${GPU_CHECK_LOGS:-$(mktemp -d -t sluice-gpu-check.XXXXXX)}
mkdir -p "$logs"
budget_s=${GPU_CHECK_BUDGET_S:-540}
started=$SECONDS
summary=()
failed=0

record() {
    summary+=("$(printf '%-5s %s: %s' "$1" "$2" "$3")")
    printf '%-5s %s: %s\n' "$1" "$2" "$3"
    [[ $1 == FAIL ]] && failed=1
    return 0
}

# The interpreter: $PYTHON, else a checkout's .venv, else python3; with a wheelhouse, a venv
# made from python3.12 (or $PYTHON) that sees the system's packages, installed offline.
wheelhouse=${GPU_CHECK_WHEELHOUSE:-}
if [[ -n $wheelhouse ]]; then
    base=${PYTHON:-$(command -v python3.12 || command -v python3)}
    venv=${GPU_CHECK_VENV:-$logs/venv}
    requirements=${GPU_CHECK_REQUIREMENTS:-scripts/gpu-check-wheels.txt}
    # Within the 10 minutes: the checks after it get what it leaves. The host's pip config
    # (indexes, constraints) is ignored: only the wheelhouse counts.
    if timeout 60 "$base" -m venv --system-site-packages "$venv" >"$logs/wheelhouse.log" 2>&1 &&
        PIP_CONFIG_FILE=/dev/null timeout 150 "$venv/bin/python" -m pip install --quiet --no-index --no-deps \
            --disable-pip-version-check --find-links "$wheelhouse" --requirement "$requirements" \
            >>"$logs/wheelhouse.log" 2>&1; then
        record PASS wheelhouse "$("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])') venv $venv, installed offline from $wheelhouse"
    else
        record FAIL wheelhouse "$(grep -v '^[[:space:]]*$' "$logs/wheelhouse.log" | tail -n 1)"
    fi
    python=$venv/bin/python
elif [[ -n "${PYTHON:-}" ]]; then
    python=$PYTHON
elif [[ -x .venv/bin/python ]]; then
    python=.venv/bin/python
else
    python=python3
fi

left() { echo $((budget_s - (SECONDS - started))); }

# check NAME TIMEOUT_S COMMAND...: exit 0 is PASS, 77 is SKIP (the last output line says why),
# anything else FAIL. The command's output goes to $logs/NAME.log; its last line is shown.
check() {
    local name=$1 limit=$2 status detail rc
    shift 2
    if (($(left) < 20)); then
        record SKIP "$name" "the 10-minute budget is spent"
        return
    fi
    ((limit > $(left))) && limit=$(left)
    # A function cannot be exec'd by timeout: it runs in a child bash (the functions and
    # $python are exported below).
    timeout --kill-after=10 "$limit" bash -c "$*" >"$logs/$name.log" 2>&1
    rc=$?
    detail=$(grep -v '^[[:space:]]*$' "$logs/$name.log" | tail -n 1)
    case $rc in
        0) status=PASS ;;
        77) status=SKIP ;;
        124 | 137) status=FAIL detail="timed out after ${limit}s" ;;
        *) status=FAIL ;;
    esac
    record "$status" "$name" "$detail"
}

driver() {
    if ! command -v nvidia-smi >/dev/null; then
        echo "nvidia-smi is not installed (no NVIDIA driver)"
        return 77
    fi
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader ||
        return 77
}

python_deps() {
    "$python" - <<'EOF'
import importlib.util, sys
missing = [m for m in ("numpy", "pytest", "pydantic", "pydantic_settings", "yaml", "onnx",
                       "onnxruntime", "prometheus_client") if importlib.util.find_spec(m) is None]
print(sys.version.split()[0], sys.executable)
if missing:
    print("missing Python packages (pip install -e '.[dev,gpu]', or offline "
          "GPU_CHECK_WHEELHOUSE=DIR from scripts/gpu-wheelhouse.sh):", ", ".join(missing))
    sys.exit(77)
print("sluice's Python dependencies import")
EOF
}

# The real cuda-python under engine/backends/cuda.py, without pytest or sluice's other
# dependencies: a 64 MiB round trip through pinned memory on a non-blocking stream.
cuda_smoke() {
    PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$python" - <<'EOF'
import importlib.util, sys, time
if importlib.util.find_spec("numpy") is None:
    print("numpy is not installed"); sys.exit(77)
if importlib.util.find_spec("cuda") is None:
    print("cuda-python is not installed (pip install 'cuda-python>=12.6.1,<13')"); sys.exit(77)
import numpy as np
from engine.backends.cuda import Cuda, DeviceBuffer, PinnedBuffer, Stream, load_runtime
from engine.errors import BackendError
try:
    cuda = Cuda(load_runtime())
except ImportError as exc:
    print(f"cuda.bindings.runtime does not import: {exc}"); sys.exit(77)
count = cuda.device_count()
if count == 0:
    print(f"cuda-python sees no CUDA device ({cuda.no_device})"); sys.exit(77)
cuda.call("cudaSetDevice", 0)
name, capability = cuda.properties(0)
size = 64 << 20
data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
device, host_in, host_out = DeviceBuffer(cuda, size), PinnedBuffer(cuda, size), PinnedBuffer(cuda, size)
stream = Stream(cuda)
host_in.bytes[:] = data
start = time.perf_counter()
for _ in range(10):
    stream.copy_in(device, host_in, size)
    stream.copy_out(host_out, device, size)
stream.synchronize()
seconds = time.perf_counter() - start
assert np.array_equal(host_out.bytes, data), "device round trip corrupted the data"
try:
    cuda.call("cudaSetDevice", count + 7)
    raise AssertionError("cudaSetDevice on a missing device succeeded")
except BackendError as exc:
    assert "cudaSetDevice" in str(exc) and "cudaErrorInvalidDevice" in str(exc), str(exc)
for owned in (stream, device, host_in, host_out):
    owned.close()
print(f"{count} GPU(s); GPU 0 {name} (compute capability {capability}); "
      f"pinned H2D+D2H {20 * size / seconds / 1e9:.1f} GB/s on one non-blocking stream")
EOF
}

# What the native TensorRT paths (convert --target tensorrt, backend: tensorrt) need beyond
# cuda-python; without it the gpu-marked TensorRT tests skip and the fake engine stands in.
tensorrt_present() {
    "$python" - <<'EOF'
import importlib.util, sys
if importlib.util.find_spec("tensorrt") is None:
    print("the tensorrt package is not installed (pip install 'sluice[gpu]' "
          "--extra-index-url https://pypi.nvidia.com)"); sys.exit(77)
import tensorrt
if int(tensorrt.__version__.split(".")[0]) != 10:
    print(f"TensorRT {tensorrt.__version__}: sluice's backend is written for TensorRT 10")
    sys.exit(1)
print(f"TensorRT {tensorrt.__version__}")
EOF
}

# cupy's own kernels on this GPU: the gpu-marked tests use them on engine/backends/cuda.py's
# streams and as the fake TensorRT engine's kernels.
cupy_kernels() {
    "$python" - <<'PY'
import importlib.util, sys
if importlib.util.find_spec("cupy") is None:
    print("cupy is not installed (its gpu-marked tests skip: real kernels on sluice's streams)")
    sys.exit(77)
import cupy
x = cupy.arange(1 << 20, dtype=cupy.float32)
assert float((x * 2).sum()) == float(x.sum()) * 2
name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
print(f"cupy {cupy.__version__} (CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}) on {name}")
PY
}

# ONNX Runtime's TensorRT and CUDA providers: created, running nodes, matching CPU.
ort_providers() {
    "$python" -c "import onnxruntime" 2>/dev/null || {
        echo "onnxruntime is not installed"
        return 77
    }
    PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$python" -m engine.backends.provider_check
}

gpu_tests() {
    if ! "$python" -c "import pytest, pydantic_settings" 2>/dev/null; then
        echo "pytest or sluice's dependencies are missing (pip install -e '.[dev,gpu]')"
        return 77
    fi
    # -rA lists every test's outcome and each skip's reason. Plugins this machine may lack
    # (pytest-asyncio, pytest-timeout) only add config keys, whose warnings are ignored here.
    local rc
    "$python" -m pytest -q -p no:cacheprovider -m gpu -rA \
        -W "ignore::pytest.PytestConfigWarning" \
        tests/unit/engine/backends/test_cuda.py tests/unit/engine/backends/test_tensorrt.py \
        tests/unit/engine/backends/test_tensorrt_instance.py \
        tests/unit/engine/backends/test_onnxruntime_gpu.py tests/unit/converters/test_tensorrt.py \
        tests/unit/engine/backends/test_provider_check.py \
        tests/unit/converters/test_serving_provider.py tests/unit/engine/test_gpu_metrics.py \
        tests/unit/engine/generation/test_generation_gpu.py \
        tests/integration/test_shared_memory.py
    rc=$?
    ((rc == 5)) && { echo "no gpu-marked tests were collected"; return 77; }
    ((rc != 0)) && return "$rc"
    if ! grep -q '^PASSED ' "$logs/gpu-tests.log"; then
        echo "every gpu-marked test skipped (reasons above)"
        return 77
    fi
    echo "$(grep -c '^PASSED ' "$logs/gpu-tests.log") gpu-marked test(s) passed"
}

nvml() {
    "$python" - <<'EOF'
import importlib.util, sys
if importlib.util.find_spec("pynvml") is None:
    print("nvidia-ml-py (pynvml) is not installed"); sys.exit(77)
import pynvml
pynvml.nvmlInit()
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    memory = pynvml.nvmlDeviceGetMemoryInfo(h)
    util = pynvml.nvmlDeviceGetUtilizationRates(h)
    print(f"GPU {i} {pynvml.nvmlDeviceGetName(h)}: {util.gpu}% busy, "
          f"{memory.used >> 20} of {memory.total >> 20} MiB used")
EOF
}

export python logs
export -f driver python_deps cuda_smoke cupy_kernels tensorrt_present ort_providers gpu_tests nvml
echo "sluice GPU check: python $python, logs in $logs"
check driver 30 driver
check python-deps 60 python_deps
check cuda-python 120 cuda_smoke
check cupy 60 cupy_kernels
check nvml 30 nvml
check tensorrt 60 tensorrt_present
check onnxruntime-gpu 120 ort_providers
check gpu-tests 360 gpu_tests

echo
echo "== gpu-marked tests (from $logs/gpu-tests.log) =="
grep -E '^(PASSED|SKIPPED|FAILED|ERROR) ' "$logs/gpu-tests.log" 2>/dev/null ||
    echo "(none ran)"
echo
echo "== summary ($((SECONDS - started)) s) =="
printf '%s\n' "${summary[@]}"
echo
echo "== not checked on this machine (each SKIP above says why) =="
printf '%s\n' "${summary[@]}" | sed -n 's/^SKIP  //p' | grep . || echo "(nothing: every check ran)"
exit $failed
