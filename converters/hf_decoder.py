"""Hugging Face causal-LM folders (GPT-2 and Llama-style `*ForCausalLM` with a `tokenizer.json`)
as ONNX decoders: telling the folder apart, loading it (model, fast tokenizer and the decoder's
shape), exporting it with its key/value cache as inputs and outputs, and int8 quantization.

The decoder's contract, which engine/generation relies on (batch, sequence and past are
dynamic; total = past + sequence):

    inputs   input_ids [batch, sequence] INT64, attention_mask [batch, total] INT64,
             position_ids [batch, sequence] INT64,
             past_key_values.{i}.key / .value [batch, kv_heads, past, head_dim] FP32
    outputs  logits [batch, sequence, vocab] FP32,
             present.{i}.key / .value [batch, kv_heads, total, head_dim] FP32

A zero in attention_mask hides that cache position, so sequences of different past lengths
share one batch with padded caches."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ConversionError, MissingDependency
from converters.hf_encoder import refuse_remote_code
from converters.quiet import quiet

OPSET = 17


def is_causal_lm_folder(text: str) -> bool:
    """Whether SOURCE is a folder with a config.json naming a *ForCausalLM architecture."""
    config = Path(text) / "config.json"
    if not config.is_file():
        return False
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(
        str(name).endswith("ForCausalLM") or name == "GPT2LMHeadModel" for name in architectures
    )


@dataclass(frozen=True)
class DecoderShape:
    """What the server needs to know of the decoder to run it."""

    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    eos_token_ids: list[int]

    @property
    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")]

    @property
    def present_names(self) -> list[str]:
        return [f"present.{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")]


def load_decoder(folder: Path) -> tuple[Any, Any, DecoderShape]:
    """The folder's model (eager attention, none of the folder's own code), its fast tokenizer
    and the decoder's shape."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as exc:
        raise MissingDependency(
            "converting a Hugging Face causal LM",
            [f"{exc.name} is not installed (pip install 'sluice[convert]')"],
        ) from exc
    if not (folder / "tokenizer.json").is_file():
        raise ConversionError(
            f"'{folder}' has no tokenizer.json; a generative model needs its fast tokenizer file"
        )
    from tokenizers import Tokenizer

    refuse_remote_code(folder)
    with quiet():
        try:
            model: Any = transformers.AutoModelForCausalLM.from_pretrained(
                folder, local_files_only=True, attn_implementation="eager", trust_remote_code=False
            )
            model.eval()
        except Exception as exc:
            raise ConversionError(f"transformers cannot load '{folder}': {exc}") from exc
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    context = getattr(config, "max_position_embeddings", None) or config.n_positions
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = config.eos_token_id
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    shape = DecoderShape(
        layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=int(head_dim),
        vocab=config.vocab_size,
        context_length=int(context),
        eos_token_ids=eos_ids,
    )
    return model, tokenizer, shape


def decoder_wrapper(model: Any, shape: DecoderShape) -> Any:
    """The model as a function of flat tensors: (ids, mask, positions, *past) -> (logits,
    *present); the cache object transformers expects is built inside, so tracing sees tensors."""
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers 5.x renamed the argument to `cache` (the old name warns); older ones take
    # only `past_key_values`.
    parameters = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in parameters else "past_key_values"

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any
        ) -> Any:
            cache = DynamicCache(config=self.model.config)
            for layer in range(shape.layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{cache_arg: cache},
            )
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    # eval() on the wrapper, not only the model: export restores the wrapper's training flag
    # recursively, and a wrapper left in training mode would turn dropout on in the model.
    return Decoder().eval()


def example_feed(
    shape: DecoderShape, batch: int, past: int, sequence: int, seed: int
) -> dict[str, np.ndarray]:
    """Random decoder inputs; row 0 has one hidden cache position (when there is a past), so
    padding masks are exercised."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, past + sequence), np.int64)
    if past > 1:
        mask[0, 0] = 0
    feed = {
        "input_ids": rng.integers(0, shape.vocab, (batch, sequence), dtype=np.int64),
        "attention_mask": mask,
        "position_ids": np.broadcast_to(np.arange(past, past + sequence), (batch, sequence))
        .astype(np.int64)
        .copy(),
    }
    for name in shape.past_names:
        feed[name] = rng.standard_normal((batch, shape.kv_heads, past, shape.head_dim)).astype(
            np.float32
        )
    return feed


def export_decoder(model: Any, shape: DecoderShape, path: Path) -> None:
    """torch.onnx.export (TorchScript tracer: the cache's Python logic traces into plain tensor
    ops) with dynamic batch, sequence and past axes."""
    import torch

    feed = example_feed(shape, batch=2, past=3, sequence=4, seed=0)
    args = tuple(torch.from_numpy(feed[name]) for name in feed)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    axes |= {name: {0: "batch", 2: "past"} for name in shape.past_names}
    axes |= {name: {0: "batch", 2: "total"} for name in shape.present_names}
    with quiet(), torch.no_grad():
        try:
            torch.onnx.export(
                decoder_wrapper(model, shape),
                args,
                str(path),
                input_names=list(feed),
                output_names=["logits", *shape.present_names],
                dynamic_axes=axes,
                opset_version=OPSET,
                dynamo=False,
            )
        except Exception as exc:
            raise ConversionError(f"exporting the decoder to ONNX failed: {exc}") from exc


def quantize_int8(source: Path, target: Path) -> None:
    """Dynamic int8 quantization of the weights (MatMul/Gemm), activations stay fp32; 7-bit
    weights, so that x86 kernels without VNNI do not saturate (see
    converters.optimize.U8S8_WEIGHT_LIMIT)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet():
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, reduce_range=True)
