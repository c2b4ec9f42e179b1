"""A loaded model's effective configuration in Triton's JSON model-config shape."""

from __future__ import annotations

from typing import Any

from engine.model import LoadedModel
from engine.model_config import GPU_PROVIDERS
from engine.types import TensorSpec

_TYPES = {
    "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
    "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64", "BYTES": "TYPE_STRING",
}  # fmt: skip


_FILES = {"tensorrt": "model.plan", "tokenizer": "tokenizer.json", "python": "model.py"}


def _tensor(spec: TensorSpec, batched: bool) -> dict[str, Any]:
    dims = list(spec.shape[1:] if batched else spec.shape)
    return {"name": spec.name, "data_type": _TYPES[spec.datatype], "dims": dims}


def instance_groups(model: LoadedModel) -> list[dict[str, Any]]:
    """Triton's instance_group: KIND_GPU with the devices for gpu groups, and for a bare count
    whose session runs on a GPU provider (device 0)."""
    config = model.config
    on_gpu = not isinstance(config.instances, list) and model.backend.provider in GPU_PROVIDERS
    groups = []
    for index, group in enumerate(config.instance_groups):
        entry: dict[str, Any] = {"name": f"{model.name}_{index}", "count": group.count}
        if group.kind == "gpu" or on_gpu:
            entry |= {"kind": "KIND_GPU", "gpus": group.gpus or [0]}
        else:
            entry["kind"] = "KIND_CPU"
        groups.append(entry)
    return groups


def triton_config(model: LoadedModel) -> dict[str, Any]:
    """What Triton's `GET /v2/models/{name}/config` would answer for this model."""
    config = model.config
    batched = model.max_batch_size > 0
    policy = config.version_policy
    if policy.all:
        version_policy: dict[str, Any] = {"all": {}}
    elif policy.specific is not None:
        version_policy = {"specific": {"versions": policy.specific}}
    else:
        version_policy = {"latest": {"num_versions": policy.latest}}
    batch_policy = model.batcher.policy
    result: dict[str, Any] = {
        "name": model.name,
        "platform": model.backend.platform,
        "backend": config.backend,
        "version_policy": version_policy,
        "max_batch_size": model.max_batch_size,
        "input": [_tensor(spec, batched) for spec in model.backend.inputs],
        "output": [_tensor(spec, batched) for spec in model.backend.outputs],
        "instance_group": instance_groups(model),
        "default_model_filename": _FILES.get(config.backend, "model.onnx"),
        # sluice's own config as written (what a load's `config` parameter takes back, which
        # is how `sluice tune` restores it).
        "parameters": {
            "sluice_config": {"string_value": config.model_dump_json(exclude_unset=True)}
        },
    }
    if config.pipeline is not None:  # Triton's ensemble: the steps batch, the pipeline does not
        result["ensemble_scheduling"] = {
            "step": [
                {
                    "model_name": step.model,
                    "model_version": int(step.version) if step.version else -1,
                    "input_map": dict(step.inputs),
                    "output_map": dict(step.outputs),
                }
                for step in config.pipeline.steps
            ]
        }
        del result["default_model_filename"], result["instance_group"]
    elif batched and config.dynamic_batching.enabled:
        result["dynamic_batching"] = {
            "preferred_batch_size": list(batch_policy.preferred_batch_sizes),
            # `auto` has no Triton equivalent: 0, as the window is planned per batch.
            "max_queue_delay_microseconds": (
                0 if batch_policy.auto else int(float(batch_policy.max_queue_delay_s) * 1e6)
            ),
            "preserve_ordering": False,
            "priority_levels": batch_policy.priority_levels,
            "default_priority_level": config.dynamic_batching.default_level,
            "default_queue_policy": {
                "max_queue_size": batch_policy.max_queue_size,
                "default_timeout_microseconds": int(
                    (config.dynamic_batching.default_timeout_s or 0) * 1e6
                ),
                "allow_timeout_override": True,
                "timeout_action": "REJECT",
            },
        }
    return result
