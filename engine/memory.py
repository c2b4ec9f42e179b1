"""Measuring what a loaded model costs: the bytes the C allocator holds for the process (host)
and the memory in use on each GPU (NVML), read before and after a load.

Host bytes are glibc's own count of the bytes it has handed out and not yet taken back
(`mallinfo2`: in use in its arenas plus its mmapped blocks). Why that and not ONNX Runtime's
numbers: ORT's Python API reports no arena statistics, and a version costs more than its arena
(the session's graph and initializers, pre-packed weights, a tokenizer or Python step beside
it), all of it from malloc. Why not the resident set: it also moves with pages the kernel
reclaims or faults in (the runtime's code, on a busy host) and with free pages glibc keeps,
which made the same model measure 0 to 11 MB across runs; the allocator's count measured the
same bytes on every load. What it misses: Python's small-object heap (pymalloc, a few KB per
model) and thread stacks. Its error: anything else allocated or freed during the load (another
load overlapping it, requests' tensors) counts too, so loads are measured one at a time by
default (`max_concurrent_loads: 1`). Where glibc is not the C library, the anonymous resident
set (RssAnon), after handing free pages back, stands in. Blocking calls: run them off the
event loop.

An eviction gives the memory back to the system, not only to the books: closing the sessions
frees their allocations and `release_free_memory` (malloc_trim) returns glibc's free pages, so
the resident set falls by what the books say (tests/integration/test_on_demand.py checks it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Any

log = logging.getLogger("sluice.memory")


def rss_bytes() -> int:
    """The process's anonymous resident set now (its heaps, not its mapped files), or 0 where
    /proc is not there."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split(" ")]  # glibc's


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim"):
        return None
    if hasattr(libc, "mallinfo2"):  # glibc 2.33 and later
        libc.mallinfo2.restype = _MallInfo2
    return libc


M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1024 * 1024


def map_large_blocks() -> None:
    """Make glibc serve every block of 1 MiB or more with its own mapping, for good.

    glibc starts at 128 KiB but raises that threshold each time such a block is freed (up to
    32 MiB), so after the first unload a session's weights and arena blocks land in the heap
    instead, among small long-lived allocations; freed, they leave holes that `malloc_trim`
    cannot hand back whole (a load/evict loop of three 4-11 MB models kept 20-40 MB more
    resident than its books). Mapped blocks go back to the system the moment they are freed.
    The price: a block of 1 MiB or more (a large request's tensors) is mapped and its pages
    faulted in on every allocation instead of reusing heap pages; 1 MiB rather than glibc's
    128 KiB keeps that off the tensors of most requests, and returned the same memory here."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def heap_bytes() -> int:
    """Bytes the C allocator has handed out and not taken back (glibc's `mallinfo2`), or the
    settled anonymous resident set where that is not available."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return settled_rss_bytes()
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def release_free_memory() -> None:
    """Hand glibc's free heap pages back to the system (`malloc_trim(0)`): after an unload the
    freed session memory otherwise stays in the process's arenas, counted in its resident set.
    A no-op on other C libraries (musl returns free pages by itself)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def settled_rss_bytes() -> int:
    """The anonymous resident set once free pages are handed back."""
    release_free_memory()
    return rss_bytes()


class GpuMemory:
    """Memory in use on each GPU, from NVML; empty without NVML or a device.

    The device's count, not this process's: NVML's per-process list names processes by their
    host PID, which a process in a container cannot match to its own, so a per-process reading
    would be 0 there. The error: another process allocating on the same GPU during a load is
    counted in that load (serve a GPU from one server)."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._count = int(pynvml.nvmlDeviceGetCount())
        except Exception:  # ImportError, or NVMLError: no driver, no device
            self._nvml = None
            self._count = 0

    @property
    def devices(self) -> int:
        return self._count

    def used_bytes(self) -> dict[int, int]:
        """Bytes in use on each GPU, by device index."""
        if self._nvml is None:
            return {}
        nvml, used = self._nvml, {}
        for index in range(self._count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                used[index] = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception:  # a device that stopped answering: not measured this time
                continue
        return used


def prime_runtime(gpus: int = 0) -> None:
    """Import ONNX Runtime and run one tiny session (and one on each of the first `gpus` GPUs,
    where the CUDA provider is there), so that the runtime's one-time cost (its libraries, its
    environment and logging, each GPU's CUDA context: hundreds of MB of device memory) is in the
    baseline, not in the first model's bytes."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    # A convolution and a matrix product: on a GPU they also start cuDNN and cuBLAS, whose
    # handles and kernels would otherwise be charged to the first model that uses them.
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "k"], ["c"]),
            helper.make_node("MatMul", ["c", "w"], ["y"]),
        ],
        "prime",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])],
        [
            numpy_helper.from_array(np.ones((1, 1, 1, 1), np.float32), "k"),
            numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    placements: list[list[Any]] = [["CPUExecutionProvider"]]
    placements += [
        [("CUDAExecutionProvider", {"device_id": str(device)}), "CPUExecutionProvider"]
        for device in range(gpus if cuda else 0)
    ]
    for providers in placements:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        session.run(None, {"x": np.zeros((1, 1, 4, 4), np.float32)})
        del session
