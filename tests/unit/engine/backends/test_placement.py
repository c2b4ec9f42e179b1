"""engine.backends.placement: node placement read from a real CPU session, and the
require_providers check against sessions that report their placement as ONNX Runtime does
(`get_providers()`, `get_provider_graph_assignment_info()` -> subgraphs with `ep_name` and
`get_nodes()`), including the case the old check let through: TensorRT created, every node on
CUDA."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime as ort
import pytest

from engine.backends.placement import RECORD_PLACEMENT, check_required, describe, node_placement
from engine.demo import mlp_model
from engine.errors import BackendError
from tests.models import write_model

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"


def cpu_session(tmp_path: Path, record: bool) -> tuple[ort.InferenceSession, int]:
    model = mlp_model()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if record:
        options.add_session_config_entry(RECORD_PLACEMENT, "1")
    path = write_model(tmp_path, "m", model)
    return ort.InferenceSession(str(path), options, providers=[CPU]), len(model.graph.node)


def test_the_placement_of_a_real_session_counts_every_node(tmp_path: Path) -> None:
    session, nodes = cpu_session(tmp_path, record=True)
    assert nodes > 1
    assert node_placement(session) == {CPU: nodes}


def test_without_recording_the_placement_is_unknown(tmp_path: Path) -> None:
    session, _ = cpu_session(tmp_path, record=False)
    assert node_placement(session) is None


@dataclass
class Node:
    name: str
    op_type: str
    domain: str = ""


@dataclass
class Subgraph:
    ep_name: str
    nodes: list[Node]

    def get_nodes(self) -> list[Node]:
        return self.nodes


@dataclass
class ReportingSession:
    """A session as ONNX Runtime >= 1.24 shows it: registered providers and node placement."""

    providers: list[str]
    placement: list[tuple[str, int]] = field(default_factory=list)

    def get_providers(self) -> list[str]:
        return self.providers

    def get_provider_graph_assignment_info(self) -> list[Subgraph]:
        return [
            Subgraph(ep, [Node(f"{ep}_{i}", "MatMul") for i in range(count)])
            for ep, count in self.placement
        ]


@dataclass
class OldSession:
    """A session of an onnxruntime older than 1.24: no placement to ask for."""

    providers: list[str]

    def get_providers(self) -> list[str]:
        return self.providers


def test_tensorrt_created_but_every_node_on_cuda_is_refused() -> None:
    # TensorRT is registered first, so the old check (first registered provider) passed it.
    session = ReportingSession([TRT, CUDA, CPU], [(CUDA, 9), (CPU, 2), (CUDA, 3)])
    assert node_placement(session) == {CUDA: 12, CPU: 2}
    with pytest.raises(BackendError) as caught:
        check_required("model 'm' version 1", TRT, session, [TRT, CUDA, CPU])
    assert str(caught.value).startswith(
        "model 'm' version 1 requires TensorrtExecutionProvider (onnxruntime.require_providers), "
        "but none of the model's nodes run on it (12 nodes on CUDAExecutionProvider, 2 on "
        "CPUExecutionProvider): the provider was created but took no node"
    )


def test_the_required_provider_running_some_nodes_passes() -> None:
    session = ReportingSession([TRT, CUDA, CPU], [(TRT, 1), (CPU, 2)])
    check_required("model 'm' version 1", TRT, session, [TRT, CUDA, CPU])
    assert describe(node_placement(session) or {}) == (
        "2 nodes on CPUExecutionProvider, 1 on TensorrtExecutionProvider"
    )


def test_a_provider_that_was_not_created_is_named_with_the_fix() -> None:
    with pytest.raises(BackendError) as caught:
        check_required("model 'm'", CUDA, ReportingSession([CPU], [(CPU, 4)]), [CPU])
    assert str(caught.value) == (
        "model 'm' requires CUDAExecutionProvider (onnxruntime.require_providers), but "
        "CPUExecutionProvider runs: this onnxruntime build has CPUExecutionProvider; GPU "
        "providers need onnxruntime-gpu (the `gpu` extra) and CUDA, cuDNN (and for TensorRT, "
        "libnvinfer) libraries that match it"
    )


def test_an_onnxruntime_that_cannot_report_placement_cannot_vouch_for_a_gpu_provider() -> None:
    with pytest.raises(BackendError, match=r"needs onnxruntime 1\.24 or later"):
        check_required("model 'm'", CUDA, OldSession([CUDA, CPU]), [CUDA, CPU])
    check_required("model 'm'", CPU, OldSession([CPU]), [CPU])  # CPU takes what is left: fine
