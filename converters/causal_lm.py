"""Convert a Hugging Face causal-LM folder (GPT-2 and Llama-style `*ForCausalLM` with a
`tokenizer.json`) into a generative repository model: an ONNX decoder that takes and returns
its key/value cache, validated against transformers and published with its tokenizer.

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

import datetime
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ConversionError, MissingDependency
from converters.hf_encoder import refuse_remote_code
from converters.options import ConvertOptions
from converters.publish import check_name, config_text, publish
from converters.quiet import quiet
from converters.report import Report, Steps
from converters.validate import OutputCheck, Tolerances, Validation, compare, tolerances_for

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
SAMPLE_PROMPTS = ("The quick brown fox", "Hello, my name is", "a")
GREEDY_TOKENS = 12
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
    return any(str(name).endswith("ForCausalLM") or name == "GPT2LMHeadModel" for name in
               architectures)  # fmt: skip


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


def _load(folder: Path) -> tuple[Any, Any, DecoderShape]:
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


def _wrapper(model: Any, shape: DecoderShape) -> Any:
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


def example_feed(shape: DecoderShape, batch: int, past: int, sequence: int, seed: int) -> dict[
        str, np.ndarray]:  # fmt: skip
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
                _wrapper(model, shape),
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
    """Dynamic int8 quantization of the weights (MatMul/Gemm), activations stay fp32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet():
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)


class _TorchRunner:
    def __init__(self, model: Any, shape: DecoderShape) -> None:
        self.wrapper = _wrapper(model, shape)
        self.output_names = ["logits", *shape.present_names]

    def run(self, feeds: Any) -> list[np.ndarray]:
        import torch

        with quiet(), torch.no_grad():
            outs = self.wrapper(
                *(torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values())
            )
        return [o.numpy() for o in outs]


class _OrtRunner:
    def __init__(self, path: Path, shape: DecoderShape) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.output_names = ["logits", *shape.present_names]

    def run(self, feeds: Any) -> list[np.ndarray]:
        return list(self.session.run(self.output_names, dict(feeds)))


def onnx_greedy(runner: _OrtRunner, shape: DecoderShape, prompt: list[int], steps: int) -> list[
        int]:  # fmt: skip
    """Greedy decoding with the ONNX decoder and its cache (one prompt, no early stop)."""
    past = {n: np.zeros((1, shape.kv_heads, 0, shape.head_dim), np.float32)
            for n in shape.past_names}  # fmt: skip
    ids, out = list(prompt), []
    new = prompt
    for _ in range(steps):
        length = len(ids)
        feed = {
            "input_ids": np.array([new], np.int64),
            "attention_mask": np.ones((1, length), np.int64),
            "position_ids": np.arange(length - len(new), length, dtype=np.int64)[None],
            **past,
        }
        logits, *present = runner.run(feed)
        past = dict(zip(shape.past_names, present, strict=True))
        token = int(np.argmax(logits[0, -1]))
        out.append(token)
        ids.append(token)
        new = [token]
    return out


def onnx_next_tokens(runner: _OrtRunner, shape: DecoderShape, ids: list[int]) -> list[int]:
    """The decoder's argmax at every position of `ids` (one run, no cache)."""
    feed = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None],
        **{
            n: np.zeros((1, shape.kv_heads, 0, shape.head_dim), np.float32)
            for n in shape.past_names
        },
    }
    return [int(t) for t in np.argmax(runner.run(feed)[0][0], axis=-1)]


def torch_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers `generate`, greedy, exactly `steps` new tokens."""
    import torch

    with quiet(), torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in generated[0, len(prompt) :]]


def validate(
    model: Any, tokenizer: Any, shape: DecoderShape, path: Path, tolerances: Tolerances, seed: int
) -> Validation:
    """Logits and caches against transformers on random cached inputs (padded rows included),
    then greedy tokens on sample prompts: `generate` and the ONNX decoder's own cached loop."""
    onnx_runner = _OrtRunner(path, shape)
    batches = [
        example_feed(shape, batch=1, past=0, sequence=6, seed=seed),
        example_feed(shape, batch=3, past=5, sequence=1, seed=seed + 1),
        example_feed(shape, batch=2, past=4, sequence=3, seed=seed + 2),
    ]
    validation = compare(_TorchRunner(model, shape), onnx_runner, batches, tolerances)
    check = OutputCheck("greedy tokens")
    differ = total = 0
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer.encode(prompt).ids or [0]
        steps = min(GREEDY_TOKENS, shape.context_length - len(ids))
        want = torch_greedy(model, ids, steps)
        total += len(want)
        if tolerances.max_mismatch == 0:
            # Exact precision: the decoder's own cached loop must give generate's tokens.
            got = onnx_greedy(onnx_runner, shape, ids, steps)
            first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), -1)
            if first >= 0:
                differ += len(want) - first
                check.reasons.append(f"'{prompt}': first differs at token {first}")
        else:
            # Quantized: one divergence changes every later token, so compare the next-token
            # choice at each position of generate's own continuation (teacher forcing).
            got = onnx_next_tokens(onnx_runner, shape, ids + want[:-1])[len(ids) - 1 :]
            differ += sum(a != b for a, b in zip(want, got, strict=True))
    check.mismatch = differ / max(total, 1)
    if check.mismatch > tolerances.max_mismatch:
        check.passed = False
        check.reasons.append(
            f"{check.mismatch:.1%} of greedy tokens differ from transformers; at most "
            f"{tolerances.max_mismatch:.1%} may"
        )
    else:
        check.reasons.clear()
    validation.outputs.append(check)
    return validation


def generative_config(shape: DecoderShape) -> dict[str, Any]:
    """config.yaml for the published model: unbatched by the dynamic batcher (the generation
    scheduler batches it), no warm-up (the cache inputs have no fixed shape)."""
    return {
        "backend": "onnxruntime",
        "max_batch_size": 0,
        "dynamic_batching": {"enabled": False},
        "warmup": {"enabled": False},
        "generative": {
            "context_length": shape.context_length,
            "eos_token_ids": shape.eos_token_ids,
        },
    }


def convert_causal_lm(options: ConvertOptions, steps: Steps) -> Report:
    """Load, export, (quantize,) validate and publish a causal LM folder."""
    report = steps.report
    report.precision, report.target = options.precision, options.target
    if options.target != "onnxruntime" or options.precision == "fp16":
        raise ConversionError(
            f"a causal LM converts to onnxruntime fp32 or int8; got {options.target} "
            f"{options.precision}"
        )
    folder = Path(options.source)
    with steps.step("load source") as step:
        model, tokenizer, shape = _load(folder)
        report.source_kind = "causal_lm"
        report.name = check_name(options.name or folder.resolve().name)
        step.detail = (
            f"{type(model).__name__}: {shape.layers} layers, {shape.kv_heads} kv heads, "
            f"context {shape.context_length}"
        )
    with tempfile.TemporaryDirectory(prefix="sluice-causal-lm-") as scratch:
        path = Path(scratch) / "model.onnx"
        with steps.step("export to ONNX") as step:
            export_decoder(model, shape, path)
            if options.precision == "int8":
                quantized = Path(scratch) / "model.int8.onnx"
                quantize_int8(path, quantized)
                path = quantized
            step.detail = f"opset {OPSET}, past key/values in and out"
        payload = path.read_bytes()
        report.model_bytes = len(payload)
        report.inputs = [{"name": n} for n in ("input_ids", "attention_mask", "position_ids")]
        report.outputs = [{"name": "logits"}]
        with steps.step("validate") as step:
            tolerances = tolerances_for(
                options.precision, options.atol, options.rtol, options.min_cosine,
                options.max_norm_error,
            )  # fmt: skip
            report.validation = validate(model, tokenizer, shape, path, tolerances, options.seed)
            report.validated_on = "onnxruntime CPUExecutionProvider"
            step.detail = "passed" if report.validation.passed else "FAILED"
            step.failed = not report.validation.passed
    if not report.may_publish(options.force, options.dry_run):
        return report
    with steps.step("publish") as step:
        header = [
            f"Generated by `sluice convert` from {options.source} ({options.precision}, "
            f"generative decoder) on {datetime.date.today().isoformat()}.",
            f"{shape.layers} layers, {shape.kv_heads} kv heads of {shape.head_dim}, "
            f"vocabulary {shape.vocab}.",
        ]
        extra = {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}
        published = publish(
            options.repository,
            report.name,
            options.version,
            "model.onnx",
            payload,
            config_text(generative_config(shape), header),
            report.to_json(),
            options.replace_config,
            extra_files=extra,
        )
        report.published = {
            "model_path": str(published.model_path),
            "version": published.version,
            "config_written": published.config_written,
        }
        step.detail = f"version {published.version}"
    return report
