"""engine/generation/genai.py's premises about the installed onnxruntime-genai that the guide
states (docs/guides/generative.md: static batching on CPU, LoRA adapters, GPT-2): when a release
changes them, this fails and the guide (and the serving code) must follow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime_genai as og


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_the_engine_has_no_per_request_adapter() -> None:
    # An adapter is chosen with Generator.set_active_adapter (one generator, one sequence); the
    # Engine's request, turn and request options have no such choice, so LoRA cannot ride on
    # the Engine's continuous batch.
    assert "set_active_adapter" in public(og.Generator)
    assert public(og.Adapters) == {"load", "unload"}
    engine_side = public(og.Engine) | public(og.Request) | public(og.TurnOptions)
    engine_side |= public(og.RequestOptions)
    assert not {name for name in engine_side if "adapter" in name or "lora" in name}


def genai_config_for_sluice_gpt2(hf: Path, version: Path) -> None:
    """A genai_config.json for the decoder `sluice convert` exported from the GPT-2 folder `hf`,
    as the library's generic decoder ("llama": named key/value inputs, position_ids fed; its
    "gpt2" type wants the legacy rank-5 `past_%d` tensors instead)."""
    gpt2 = json.loads((hf / "config.json").read_text())
    eos = int(gpt2["eos_token_id"])
    heads, width = int(gpt2["n_head"]), int(gpt2["n_embd"])
    config = {
        "model": {
            "type": "llama",
            "bos_token_id": eos,
            "eos_token_id": eos,
            "pad_token_id": eos,
            "context_length": int(gpt2["n_positions"]),
            "vocab_size": int(gpt2["vocab_size"]),
            "decoder": {
                "filename": "model.onnx",
                "head_size": width // heads,
                "hidden_size": width,
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "num_hidden_layers": int(gpt2["n_layer"]),
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {"max_length": int(gpt2["n_positions"]), "past_present_share_buffer": False},
    }
    (version / "genai_config.json").write_text(json.dumps(config))


def engine_greedy(model: og.Model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy tokens of `prompts` submitted together to one Engine."""
    engine = og.Engine(model)
    buffer = engine.create_event_buffer(64)
    requests = []
    for prompt in prompts:
        request = engine.create_request()
        turn = og.TurnOptions(request)
        turn.set_max_generated_tokens(tokens)
        turn.set_do_sample(False)
        request.begin_turn(np.asarray(prompt, dtype=np.int32), turn)
        requests.append(request)
    out: list[list[int]] = [[] for _ in prompts]
    while engine.has_pending_requests():
        for event in engine.run(buffer):
            if int(event.flags) & int(og.EngineEventFlags.TOKEN):
                out[requests.index(event.request)].append(int(event.token))
    return out


def test_sluices_gpt2_export_is_right_alone_and_wrong_batched_on_the_engine(
    tiny_gpt2_built: tuple[Path, Path], tmp_path: Path
) -> None:
    # Why GPT-2 folders stay on sluice's own scheduler (docs/guides/generative.md): the Engine
    # runs sluice's export, greedy-identical to transformers one request at a time, but batches
    # prompts of different lengths so that the shorter ones get other tokens.
    from tokenizers import Tokenizer

    from tests.generative import SENTENCES, reference_greedy

    hf, repository = tiny_gpt2_built
    version = tmp_path / "gpt2"
    shutil.copytree(repository / "tiny" / "1", version)
    genai_config_for_sluice_gpt2(hf, version)
    model = og.Model(str(version))
    tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in (SENTENCES[0], "a batcher", SENTENCES[2])]
    want = [reference_greedy(hf, prompt, 10) for prompt in prompts]
    assert [engine_greedy(model, [prompt], 10)[0] for prompt in prompts] == want
    together = engine_greedy(model, prompts, 10)
    # Prompts of 9, 2 and 8 tokens: the longest row is right, the shorter ones are not.
    assert [len(prompt) for prompt in prompts] == [9, 2, 8]
    assert [got == expected for got, expected in zip(together, want, strict=True)] == [
        True,
        False,
        False,
    ]


def test_on_cpu_the_engine_runs_batches_of_four_to_their_end(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    # Static batching (every CPU build): at most 4 requests a step whatever
    # engine.static_batching.max_batch_size (sluice's max_running_sequences) says, though
    # get_capabilities() echoes it; and a batch runs until its longest request ends: the fifth
    # request waits 8 steps after three places came free (no continuous batching).
    for batch in (2, 8):
        config = og.Config(str(tiny_genai_built[1]))
        config.overlay(json.dumps({"engine": {"static_batching": {"max_batch_size": batch}}}))
        engine = og.Engine(og.Model(config))
        assert engine.get_capabilities().configured_max_batch_size == batch
        buffer = engine.create_event_buffer(64)
        requests = [engine.create_request() for _ in range(5)]  # a dropped one is closed
        for request, tokens in zip(requests, [10, 2, 2, 2, 2], strict=True):
            turn = og.TurnOptions(request)
            turn.set_max_generated_tokens(tokens)
            turn.set_do_sample(False)
            request.begin_turn(np.asarray([0, 5, 7, 9], dtype=np.int32), turn)
        steps = []
        while engine.has_pending_requests():
            steps.append(sorted(requests.index(event.request) for event in engine.run(buffer)))
        assert steps == [[0, 1, 2, 3]] * 2 + [[0]] * 8 + [[4]] * 2, batch


def test_on_cpu_a_closed_request_gives_no_place_until_its_batch_ends(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    # Closing a request (a cancel, a client gone) stops its tokens at once, but a waiting
    # request starts only when the rest of the batch has ended.
    engine = og.Engine(og.Model(str(tiny_genai_built[1])))
    buffer = engine.create_event_buffer(64)
    requests = [engine.create_request() for _ in range(5)]
    for request, tokens in zip(requests, [10, 10, 10, 10, 2], strict=True):
        turn = og.TurnOptions(request)
        turn.set_max_generated_tokens(tokens)
        turn.set_do_sample(False)
        request.begin_turn(np.asarray([0, 5, 7, 9], dtype=np.int32), turn)
    steps = []
    while engine.has_pending_requests():
        steps.append(sorted(requests.index(event.request) for event in engine.run(buffer)))
        if len(steps) == 2:
            requests[0].close()
    assert steps == [[0, 1, 2, 3]] * 2 + [[1, 2, 3]] * 8 + [[4]] * 2
