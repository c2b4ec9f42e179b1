"""A generative model served by onnxruntime-genai: a version folder holding the output of its
model builder (`genai_config.json`, the ONNX decoder, the Hugging Face tokenizer files), found
by engine/model.py whatever the model's config.yaml says.

The model's context and end-of-text tokens come from genai_config.json; the config's
`generative:` section (optional) sets the decode batch (`max_running_sequences`, the Engine's
`static_batching.max_batch_size`), the sequences that may wait (`max_waiting_sequences`) and the
default completion. Prompts are encoded by the Hugging Face tokenizer (tokenizer.json), with the
special tokens its post-processor adds: the library's own tokenizer leaves BOS out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from engine.backends.base import CPU_PROVIDER
from engine.errors import InvalidInput
from engine.generation.config import GenerativeOptions
from engine.generation.genai_scheduler import GenaiScheduler
from engine.generation.generator import TextGenerator
from engine.generation.stats import GenerationStats
from engine.generation.text import ModelText
from engine.types import TensorSpec

GENAI_CONFIG = "genai_config.json"
_CACHE_BYTES = {1: 4, 10: 2, 16: 2}  # ONNX element types of a cache: float, float16, bfloat16


def is_genai_folder(folder: Path) -> bool:
    """Whether `folder` holds an onnxruntime-genai model (the model builder's output)."""
    return (folder / GENAI_CONFIG).is_file()


class GenaiBackend:
    """The model as the tensor routes see it: it has no tensors of its own to run (the decoder
    takes a cache only the library manages), so an inference request is refused with a 400
    pointing to the generation routes."""

    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    platform = "onnxruntime_genai"

    def __init__(self, provider: str, label: str) -> None:
        self.provider = provider
        self._label = label

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not inputs:
            return {}  # the warm-up's empty batch
        raise InvalidInput(
            f"{self._label} is a generative model (onnxruntime-genai): use /v1/completions, "
            "/v1/chat/completions or the generate extension, not tensor inference"
        )

    def close(self) -> None:
        pass


class GenaiGenerator(TextGenerator):
    """Generation on onnxruntime-genai's Engine (engine/generation/genai_scheduler.py)."""

    guided = True  # the Engine's guided decoding (llguidance) per turn

    def __init__(
        self,
        folder: Path,
        section: GenerativeOptions | None,
        label: str,
        stats: GenerationStats | None = None,
    ) -> None:
        import onnxruntime_genai as og

        genai = json.loads((folder / GENAI_CONFIG).read_text())
        self.options = genai_options(genai, section)
        context = self.options.context_length
        self.text = ModelText(folder)
        batch = self.options.max_running_sequences
        config = og.Config(str(folder))
        config.overlay(json.dumps({"engine": {"static_batching": {"max_batch_size": batch}}}))
        model = og.Model(config)
        device = str(model.device_type)
        provider = CPU_PROVIDER if device.upper() == "CPU" else f"{device}ExecutionProvider"
        self.backend = GenaiBackend(provider, label)
        self.scheduler: GenaiScheduler = GenaiScheduler(
            model,
            self.options,
            batch,
            sequence_bytes(folder, genai["model"], context),
            label,
            stats,
        )


def genai_options(genai: dict[str, Any], section: GenerativeOptions | None) -> GenerativeOptions:
    """The options a model runs with: its genai_config.json's context (lowered by the section's
    context_length) and end-of-text tokens, and the section's other fields."""
    context = int(genai["model"]["context_length"])
    eos = genai["model"].get("eos_token_id", [])
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    given = section.model_dump(exclude_unset=True) if section is not None else {}
    if given.pop("context_length", 0) > 1:
        context = min(context, section.context_length)  # type: ignore[union-attr]
    given.pop("eos_token_ids", None)
    # No max_tokens: the rest of the context, as OpenAI's API and vLLM default it.
    given.setdefault("default_max_tokens", context)
    return GenerativeOptions(context_length=context, eos_token_ids=eos_ids, **given)


def kv_budget_bytes(folder: Path, section: GenerativeOptions | None) -> int:
    """The key/value cache the model's config implies, before loading it (blocking: it reads
    the decoder's header): a whole context per place of the decode batch, as GenaiScheduler's
    `cache.budget_bytes` reports it once loaded."""
    genai = json.loads((folder / GENAI_CONFIG).read_text())
    options = genai_options(genai, section)
    one = sequence_bytes(folder, genai["model"], options.context_length)
    return one * options.max_running_sequences


def sequence_bytes(folder: Path, model: dict[str, Any], context: int) -> int:
    """Key/value cache bytes of one sequence of `context` tokens: keys and values of every
    layer, in the element type of the decoder's cache inputs."""
    import onnx

    decoder = model["decoder"]
    layers, kv_heads = int(decoder["num_hidden_layers"]), int(decoder["num_key_value_heads"])
    head = int(decoder["head_size"])
    graph = onnx.load(str(folder / decoder["filename"]), load_external_data=False).graph
    types = [i.type.tensor_type.elem_type for i in graph.input if "past" in i.name]
    element = _CACHE_BYTES.get(types[0], 4) if types else 4
    return 2 * layers * kv_heads * head * context * element
