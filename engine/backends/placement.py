"""Where an ONNX Runtime session's nodes run, and the check behind `require_providers`.

A session's registered providers (`get_providers()`) say which providers were created, not where
the nodes went: a TensorRT provider that takes no node (each falls to CUDA) is still registered
first. ONNX Runtime (1.24 and later) records each provider's subgraphs when the session config
entry `session.record_ep_graph_assignment_info` is "1", and `get_provider_graph_assignment_info()`
returns them: one `OrtEpAssignedSubgraph` per subgraph, with `ep_name` and `get_nodes()` (each
node's `name`, `op_type`, `domain`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from engine.backends.base import CPU_PROVIDER
from engine.errors import BackendError
from engine.model_config import GPU_PROVIDERS

RECORD_PLACEMENT = "session.record_ep_graph_assignment_info"
"""The session config entry that makes ONNX Runtime record node placement."""

GPU_HINT = (
    "GPU providers need onnxruntime-gpu (the `gpu` extra) and CUDA, cuDNN (and for TensorRT, "
    "libnvinfer) libraries that match it"
)


def node_placement(session: Any) -> dict[str, int] | None:
    """Nodes per provider, in the order ONNX Runtime reports them; None where this onnxruntime
    cannot say (older than 1.24, or the session was made without `RECORD_PLACEMENT`)."""
    report = getattr(session, "get_provider_graph_assignment_info", None)
    if report is None:
        return None
    try:
        subgraphs = report()
    except Exception:  # onnxruntime's Fail, when recording was not enabled for this session
        return None
    counts: Counter[str] = Counter()
    for subgraph in subgraphs:
        counts[subgraph.ep_name] += len(subgraph.get_nodes())
    return dict(counts)


def describe(counts: dict[str, int]) -> str:
    """`12 nodes on CUDAExecutionProvider, 3 on CPUExecutionProvider`, most first."""
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    parts = [f"{n} {'node' if n == 1 else 'nodes'} on {name}" for name, n in ranked[:1]]
    parts += [f"{n} on {name}" for name, n in ranked[1:]]
    return ", ".join(parts) if parts else "no nodes"


def check_required(label: str, wanted: str, session: Any, available: list[str]) -> None:
    """Raise BackendError unless `wanted` was created for the session and runs at least one of
    its nodes (where this onnxruntime reports placement)."""
    running = session.get_providers()[0]
    hint = f"; {GPU_HINT}" if wanted in GPU_PROVIDERS else ""
    if running != wanted:
        raise BackendError(
            f"{label} requires {wanted} (onnxruntime.require_providers), but {running} runs: "
            f"this onnxruntime build has {', '.join(available)}{hint}"
        )
    if wanted == CPU_PROVIDER:
        return  # CPU takes every node no other provider took: nothing can fall past it
    counts = node_placement(session)
    if counts is None:
        raise BackendError(
            f"{label} requires {wanted} (onnxruntime.require_providers), but this onnxruntime "
            "cannot report where nodes run (get_provider_graph_assignment_info needs onnxruntime "
            "1.24 or later; the `gpu` extra installs one)"
        )
    if not counts.get(wanted):
        raise BackendError(
            f"{label} requires {wanted} (onnxruntime.require_providers), but none of the "
            f"model's nodes run on it ({describe(counts)}): the provider was created but took "
            "no node (unsupported operators, types or shapes; ONNX Runtime's verbose log names "
            "them), so every node fell to the next provider"
        )
