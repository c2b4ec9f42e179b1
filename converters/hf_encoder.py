"""Hugging Face encoder folders as text models: a sentence-transformers folder (`modules.json`:
Transformer -> Pooling [-> Dense] [-> Normalize]) or a `*ForSequenceClassification` folder, with
its `tokenizer.json`. Everything is local; nothing is downloaded.

The exported graph holds all the model does after tokenization, so the served pipeline is two
steps, tokenizer -> encoder, with no Python step:

    inputs   input_ids, attention_mask [, token_type_ids]  INT64 [batch, seq]
    outputs  embeddings FP32 [batch, D]: the sentence-transformers modules themselves (pooling,
             dense layers and normalization included), traced as they run in `encode`
             or logits FP32 [batch, labels] and labels BYTES [batch]: `id2label` of the argmax,
             an ArgMax and a Gather over a constant string tensor appended to the graph

The `seq` axis name lets the server's batcher pad requests of different lengths into one batch
(dynamic_batching.pad) and bucket them by length."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from converters.errors import ConversionError, MissingDependency
from converters.quiet import quiet

TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
SEQUENCE_AXIS = "seq"
OPSET = 17
EncoderKind = Literal["embeddings", "classifier"]


def is_encoder_folder(text: str) -> bool:
    """Whether SOURCE is a folder with a config.json and either a sentence-transformers
    `modules.json` or a `*ForSequenceClassification` architecture."""
    folder = Path(text)
    if not (folder / "config.json").is_file():
        return False
    if (folder / "modules.json").is_file():
        return True
    return any(name.endswith("ForSequenceClassification") for name in _architectures(folder))


def is_hf_folder(text: str) -> bool:
    """Whether SOURCE is a Hugging Face model folder (it has a config.json), of any kind."""
    return (Path(text) / "config.json").is_file()


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")


def refuse_remote_code(folder: Path) -> None:
    """ConversionError when the folder asks transformers to import its own Python code
    (`auto_map`): sluice never runs code from a model folder (transformers would ask on stdin,
    and a piped 'y' would run it). Every loader also passes trust_remote_code=False."""
    for name in REMOTE_CODE_FILES:
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue  # absent or unreadable: the loader says so
        if isinstance(data, dict) and "auto_map" in data:
            raise ConversionError(
                f"'{folder / name}' has auto_map: the folder's own Python code would define the "
                "model, and sluice convert never runs code from a model folder; export a model "
                "of a built-in transformers architecture"
            )


def _architectures(folder: Path) -> list[str]:
    try:
        found = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [str(name) for name in found] if isinstance(found, list) else []


@dataclass
class EncoderSource:
    """A loaded folder: the torch model, its own tokenizer, and what the pipeline needs."""

    kind: EncoderKind
    folder: Path
    model: Any
    """The SentenceTransformer, or the transformers classifier."""
    tokenizer: Any
    """The source's own (transformers) tokenizer: validation tokenizes the source's way."""
    input_names: list[str]
    max_length: int
    pad_id: int
    labels: list[str] | None
    """id2label in id order, for a classifier."""
    description: str

    @property
    def output_names(self) -> list[str]:
        return ["embeddings"] if self.kind == "embeddings" else ["logits", "labels"]

    def tokenizer_json(self) -> bytes:
        """The tokenizer the source runs, as tokenizer.json: the library's in-memory fast
        tokenizer, which includes what it changed at load (sentence-transformers' do_lower_case
        adds a Lowercase normalizer the folder's file lacks); else the folder's file."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return (self.folder / "tokenizer.json").read_bytes()
        data = json.loads(backend.to_str())
        # transformers sets these per call; the tokenizer step sets its own at load.
        data["truncation"] = data["padding"] = None
        return json.dumps(data, ensure_ascii=False).encode()

    def tokens(self, texts: Sequence[str]) -> dict[str, Any]:
        """The source's tokenization of `texts` as torch tensors (padded, cut at max_length)."""
        encoded = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        return {name: encoded[name] for name in self.input_names if name in encoded}

    def run(self, texts: Sequence[str]) -> list[np.ndarray]:
        """What the source computes: sentence-transformers `encode`, or the transformers forward
        with the argmax's label."""
        import torch

        with quiet(), torch.no_grad():
            if self.kind == "embeddings":
                encoded = self.model.encode(
                    list(texts), batch_size=max(len(texts), 1), convert_to_numpy=True
                )
                return [np.asarray(encoded, dtype=np.float32)]
            logits = self.model(**self.tokens(texts)).logits.float().numpy()
        assert self.labels is not None
        names = np.array([self.labels[int(i)] for i in logits.argmax(axis=-1)], dtype=object)
        return [logits, names]


def load_encoder(folder: Path) -> EncoderSource:
    """Load a sentence-transformers or sequence-classification folder (local files only)."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as exc:
        raise MissingDependency(
            "converting a Hugging Face encoder",
            [f"{exc.name} is not installed (pip install 'sluice[convert]')"],
        ) from exc
    if not is_encoder_folder(str(folder)):
        kinds = ", ".join(_architectures(folder)) or "an architecture config.json does not name"
        raise ConversionError(
            f"'{folder}' is a Hugging Face folder of {kinds}; sluice convert takes a "
            "sentence-transformers folder (modules.json), a *ForSequenceClassification or a "
            "*ForCausalLM"
        )
    if not (folder / "tokenizer.json").is_file():
        raise ConversionError(
            f"'{folder}' has no tokenizer.json; the served pipeline's tokenizer step needs the "
            "fast tokenizer file (save the tokenizer with transformers' save_pretrained)"
        )
    refuse_remote_code(folder)
    if (folder / "modules.json").is_file():
        return _load_sentence_transformer(folder)
    with quiet():
        try:
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                folder, local_files_only=True, attn_implementation="eager", trust_remote_code=False
            ).eval()
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                folder, local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:
            raise ConversionError(f"transformers cannot load '{folder}': {exc}") from exc
    config = model.config
    if getattr(config, "problem_type", None) == "regression" or config.num_labels < 2:
        raise ConversionError(
            f"'{folder}' is a regression head ({config.num_labels} output); a classifier "
            "with id2label and 2 or more labels is expected"
        )
    labels = [str(config.id2label.get(i, f"LABEL_{i}")) for i in range(config.num_labels)]
    return EncoderSource(
        kind="classifier",
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        input_names=_forward_inputs(model),
        max_length=_max_length(tokenizer, config),
        pad_id=int(tokenizer.pad_token_id or 0),
        labels=labels,
        description=f"{type(model).__name__}: {config.num_labels} labels",
    )


def _load_sentence_transformer(folder: Path) -> EncoderSource:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise MissingDependency(
            "converting a sentence-transformers folder",
            ["sentence-transformers is not installed (pip install 'sluice[convert]')"],
        ) from exc
    with quiet():
        try:
            model = SentenceTransformer(
                str(folder),
                device="cpu",
                local_files_only=True,
                trust_remote_code=False,
                model_kwargs={"attn_implementation": "eager"},
            ).eval()
        except Exception as exc:
            raise ConversionError(f"sentence-transformers cannot load '{folder}': {exc}") from exc
    if getattr(model, "default_prompt_name", None):
        raise ConversionError(
            f"'{folder}' sets default_prompt_name '{model.default_prompt_name}': encode would "
            "prepend a prompt the served pipeline does not; clear it in "
            "config_sentence_transformers.json"
        )
    first: Any = model[0]
    encoder = getattr(first, "auto_model", None) or getattr(first, "model", None)
    if encoder is None or not hasattr(first, "tokenizer"):
        raise ConversionError(
            f"'{folder}': the first module of modules.json is a {type(first).__name__}; "
            "a Transformer module is expected"
        )
    modules = " -> ".join(type(module).__name__ for module in model)
    # sentence-transformers 6 renamed get_sentence_embedding_dimension.
    dimension = getattr(model, "get_embedding_dimension", None) or (
        model.get_sentence_embedding_dimension
    )
    return EncoderSource(
        kind="embeddings",
        folder=folder,
        model=model,
        tokenizer=first.tokenizer,
        input_names=_forward_inputs(encoder),
        max_length=int(model.max_seq_length or _max_length(first.tokenizer, encoder.config)),
        pad_id=int(first.tokenizer.pad_token_id or 0),
        labels=None,
        description=f"sentence-transformers {modules}: {dimension()} dimensions",
    )


def _forward_inputs(model: Any) -> list[str]:
    accepted = inspect.signature(model.forward).parameters
    return [name for name in TOKEN_INPUTS if name in accepted]


def _max_length(tokenizer: Any, config: Any) -> int:
    # A tokenizer saved without a limit reports a huge model_max_length; the position
    # embeddings are then the limit.
    positions = int(getattr(config, "max_position_embeddings", 0) or 512)
    declared = int(min(getattr(tokenizer, "model_max_length", positions), 1 << 30))
    return min(declared, positions)


def _wrapper(source: EncoderSource) -> Any:
    """The source as a function of token tensors, returning what the graph outputs."""
    import torch

    names = source.input_names

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = source.model

        def forward(self, *tensors: Any) -> Any:
            features = dict(zip(names, tensors, strict=True))
            if source.kind == "embeddings":
                return self.model(features)["sentence_embedding"]
            return self.model(**features).logits

    return Encoder().eval()


def export_encoder(source: EncoderSource, path: Path, opset: int | None) -> None:
    """torch.onnx.export (TorchScript tracer) with dynamic batch and `seq` axes; the example
    holds two rows of different lengths, so padding is in the traced graph."""
    import torch

    example = source.tokens(["a sample text of a few words to trace", "short"])
    args = tuple(example[name] for name in source.input_names)
    axes: dict[str, dict[int, str]] = {
        n: {0: "batch", 1: SEQUENCE_AXIS} for n in source.input_names
    }
    first_output = source.output_names[0]
    axes[first_output] = {0: "batch"}
    with quiet(), torch.no_grad():
        try:
            torch.onnx.export(
                _wrapper(source),
                args,
                str(path),
                input_names=source.input_names,
                output_names=[first_output],
                dynamic_axes=axes,
                opset_version=opset or OPSET,
                dynamo=False,
            )
        except Exception as exc:
            raise ConversionError(f"exporting the encoder to ONNX failed: {exc}") from exc


def add_label_head(model: Any, labels: Sequence[str]) -> Any:
    """Append `labels` (BYTES [batch]) = labels[argmax(logits)] to the graph."""
    from onnx import TensorProto, helper

    graph = model.graph
    table = helper.make_tensor(
        "sluice_label_names",
        TensorProto.STRING,
        [len(labels)],
        [s.encode() for s in labels],  # type: ignore[misc]  # onnx's stub omits strings
    )
    graph.initializer.append(table)
    graph.node.extend(
        [
            helper.make_node("ArgMax", ["logits"], ["sluice_label_ids"], axis=-1, keepdims=0),
            helper.make_node("Gather", ["sluice_label_names", "sluice_label_ids"], ["labels"]),
        ]
    )
    graph.output.append(helper.make_tensor_value_info("labels", TensorProto.STRING, ["batch"]))
    return model


class SourceRunner:
    """The source on {"text": rows} with `threads` torch threads: what validation and
    measurement compare against."""

    def __init__(self, source: EncoderSource, threads: int = 1) -> None:
        self.source, self.threads = source, threads
        self.output_names = source.output_names

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.source.run([str(text) for text in feeds["text"]])


class ServedRunner:
    """The converted model as the server runs it: sluice's own tokenizer step (the published
    tokenizer.json and options), then the ONNX model."""

    def __init__(self, tokenizer: Any, model: Any, input_names: Sequence[str]) -> None:
        self.tokenizer, self.model = tokenizer, model
        self.input_names = list(input_names)
        self.output_names = list(model.output_names)

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        tokens = self.tokenizer.run({"text": feeds["text"]})
        return [
            np.asarray(out, dtype=object) if out.dtype.kind in "OU" else out
            for out in self.model.run({name: tokens[name] for name in self.input_names})
        ]
