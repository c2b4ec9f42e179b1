"""Config sections of the text-pipeline models: `tokenizer:`, `python:` and `pipeline:`.

They live apart from `engine/model_config.py` (which composes them into `ModelConfig`) because
they are one concept: the steps that turn text into answers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from engine.datatypes import NUMPY_DTYPES
from engine.model_config_sections import Section

TensorName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,127}$")]


class TokenizerOptions(Section):
    direction: Literal["encode", "decode"] = "encode"
    """`encode`: BYTES `text` [-1] in, `input_ids`, `attention_mask`, `token_type_ids` (INT64
    [-1, -1]) and `truncated` (BOOL [-1]) out. `decode`: INT64 `input_ids` [-1, -1] in, BYTES
    `text` [-1] out."""
    max_length: int = Field(512, gt=0, le=1 << 20)
    """Most tokens in a row, special tokens included."""
    truncation: bool = True
    """Cut a longer row to `max_length` (and say so in `truncated`); false: such a row is a 400
    naming the input, row and length."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (e.g. [CLS] and [SEP]) when encoding."""
    pad_id: int | None = Field(None, ge=0)
    """Token id that pads rows to the longest row of the request; default: the tokenizer's own
    padding id, else the id of `[PAD]` or `<pad>`, else 0."""
    skip_special_tokens: bool = True
    """Leave special tokens (padding included) out of decoded text."""


class TensorDecl(Section):
    name: TensorName
    """Tensor name."""
    datatype: str
    """Open Inference Protocol datatype (FP32, INT64, BYTES, ...)."""
    shape: list[Annotated[int, Field(ge=-1)]]
    """Shape including the batch axis when the model batches; -1 marks a dynamic axis."""

    @model_validator(mode="after")
    def _known_datatype(self) -> TensorDecl:
        if self.datatype not in NUMPY_DTYPES:
            raise ValueError(
                f"datatype '{self.datatype}' of tensor '{self.name}' is not one of "
                f"{', '.join(NUMPY_DTYPES)}"
            )
        return self


class PythonOptions(Section):
    class_name: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The class in `model.py` to serve; default: the one class that defines both `load` and
    `infer`."""
    inputs: list[TensorDecl] = Field(min_length=1)
    """The step's inputs (a Python file cannot be inspected for them)."""
    outputs: list[TensorDecl] = Field(min_length=1)
    """The step's outputs; `infer` must return exactly these, with these datatypes."""
    parameters: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Passed to `load(config)` as `config["parameters"]`."""


class PipelineStep(Section):
    model: TensorName
    """A repository model (not itself a pipeline) that runs this step."""
    version: str | None = Field(None, pattern=r"^[0-9]+$")
    """Version of `model`; default: its highest loaded version at each request."""
    inputs: dict[TensorName, TensorName] = Field(min_length=1)
    """{step model input: pipeline tensor}, as Triton's ensemble input_map."""
    outputs: dict[TensorName, TensorName] = Field(min_length=1)
    """{step model output: pipeline tensor}, as Triton's ensemble output_map."""
    truncation: bool = True
    """For a tokenizer step: rows longer than its max_length are cut (the default, as embeddings
    want; the response's `truncated_rows` counts them); false: such a row is a 400 naming it."""


class PipelineOptions(Section):
    steps: list[PipelineStep] = Field(min_length=1)
    """The steps; they run in dependency order (a step runs once every tensor it reads exists)."""
    outputs: list[TensorName] | None = None
    """Pipeline tensors the pipeline answers with; default: every step output no step reads."""
    max_concurrency: int = Field(256, gt=0, le=65536)
    """Pipeline requests in flight at once (each step batches its own requests)."""

    @model_validator(mode="after")
    def _dataflow(self) -> PipelineOptions:
        produced: dict[str, int] = {}
        for index, step in enumerate(self.steps):
            for tensor in step.outputs.values():
                if tensor in produced:
                    raise ValueError(
                        f"pipeline tensor '{tensor}' is produced by step {produced[tensor] + 1} "
                        f"and step {index + 1} ('{step.model}'); each tensor has one producer"
                    )
                produced[tensor] = index
        for tensor in self.outputs or ():
            if tensor not in produced:
                raise ValueError(
                    f"pipeline output '{tensor}' is produced by no step; step outputs: "
                    f"{', '.join(produced)}"
                )
        self.order()  # raises on a cycle
        return self

    @property
    def inputs(self) -> list[str]:
        """Pipeline tensors some step reads and no step produces: the pipeline's own inputs."""
        produced = {t for step in self.steps for t in step.outputs.values()}
        seen: dict[str, None] = {}
        for step in self.steps:
            for tensor in step.inputs.values():
                if tensor not in produced:
                    seen[tensor] = None
        return list(seen)

    @property
    def output_names(self) -> list[str]:
        """The pipeline's outputs: as listed, or every produced tensor that no step reads."""
        if self.outputs is not None:
            return list(self.outputs)
        read = {t for step in self.steps for t in step.inputs.values()}
        return [t for step in self.steps for t in step.outputs.values() if t not in read]

    def order(self) -> list[int]:
        """Step indexes in an order where each step's inputs exist before it runs: in rounds,
        each of the steps whose inputs the rounds before produced, in list order. Each step's
        round is counted once from its producers' (a step per round, rescanning the steps
        waiting, was quadratic: 2,000 steps listed last to first took 0.35 s to load)."""
        producer = {t: i for i, step in enumerate(self.steps) for t in step.outputs.values()}
        waits: list[set[int]] = [
            {producer[t] for t in step.inputs.values() if t in producer} for step in self.steps
        ]
        readers: list[list[int]] = [[] for _ in self.steps]
        for index, producers in enumerate(waits):
            for before in producers:
                readers[before].append(index)
        rounds = [0] * len(self.steps)
        left = [len(producers) for producers in waits]
        ready = [index for index, count in enumerate(left) if not count]
        for index in ready:  # grows as the loop goes: each step once its producers are in
            for reader in readers[index]:
                rounds[reader] = max(rounds[reader], rounds[index] + 1)
                left[reader] -= 1
                if not left[reader]:
                    ready.append(reader)
        if len(ready) < len(self.steps):
            names = ", ".join(f"'{step.model}'" for i, step in enumerate(self.steps) if left[i])
            raise ValueError(f"pipeline steps {names} wait on each other's outputs (a cycle)")
        return sorted(range(len(self.steps)), key=lambda index: (rounds[index], index))
