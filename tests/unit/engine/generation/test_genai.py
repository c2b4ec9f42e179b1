"""engine/generation/genai.py's premises about the installed onnxruntime-genai that the guide
states (docs/guides/generative.md, "LoRA adapters"): when a release changes them, this fails and
the guide (and the serving code) must follow."""

from __future__ import annotations

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
