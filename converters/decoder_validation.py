"""Validation of an exported causal-LM decoder against transformers: logits and caches on random
cached inputs (padded rows included), then greedy tokens on sample prompts, either the decoder's
own cached loop (fp32) or its next-token choice along generate's continuation (int8).

Both sides stop the same way: at the first end-of-text token (kept, so a side that picks it
where the other does not is a difference) or after GREEDY_TOKENS. Neither masks end-of-text (a
`min_new_tokens` on transformers' side alone made a correct export fail whenever the model
picked it early)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from converters.hf_decoder import DecoderShape, decoder_wrapper, example_feed
from converters.quiet import quiet
from converters.validate import OutputCheck, Tolerances, Validation, compare

SAMPLE_PROMPTS = ("The quick brown fox", "Hello, my name is", "a")
GREEDY_TOKENS = 12


class _TorchRunner:
    def __init__(self, model: Any, shape: DecoderShape) -> None:
        self.wrapper = decoder_wrapper(model, shape)
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


def onnx_greedy(
    runner: _OrtRunner, shape: DecoderShape, prompt: list[int], steps: int
) -> list[int]:
    """Greedy decoding with the ONNX decoder and its cache (one prompt): at most `steps` new
    tokens, ending with the first of the model's end-of-text tokens."""
    past = {
        n: np.zeros((1, shape.kv_heads, 0, shape.head_dim), np.float32) for n in shape.past_names
    }
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
        if token in shape.eos_token_ids:
            break
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


def torch_greedy(model: Any, prompt: list[int], steps: int, eos: Collection[int]) -> list[int]:
    """transformers `generate`, greedy: at most `steps` new tokens, ending with the first of
    `eos` (the tokens the ONNX side stops at; end-of-text is never masked)."""
    import torch

    with quiet(), torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=list(eos) or None,
            pad_token_id=0,
        )
    return _until_eos([int(t) for t in generated[0, len(prompt) :]], eos)


def _until_eos(tokens: list[int], eos: Collection[int]) -> list[int]:
    """`tokens` up to and including the first end-of-text one."""
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


def first_difference(want: list[int], got: list[int]) -> int | None:
    """The first position where `got` differs from `want` (one stopping earlier included)."""
    first = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    if first is None and len(got) != len(want):
        return min(len(got), len(want))
    return first


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
        want = torch_greedy(model, ids, steps, shape.eos_token_ids)
        total += len(want)
        if tolerances.max_mismatch == 0:
            # Exact precision: the decoder's own cached loop must give generate's tokens.
            got = onnx_greedy(onnx_runner, shape, ids, steps)
            first = first_difference(want, got)
            if first is not None:
                differ += max(1, len(want) - first)
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
