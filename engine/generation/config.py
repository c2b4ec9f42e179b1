"""The `generative:` section of a model's config.yaml (written by `sluice convert` for a causal
LM folder): what the decoder's context holds and how the generation scheduler runs it."""

from __future__ import annotations

from pydantic import Field

from engine.model_config_sections import Section


class GenerativeOptions(Section):
    context_length: int = Field(0, ge=0)
    """Tokens one sequence may hold, prompt and completion together (the model's positions).
    Required for a `sluice convert` decoder; an onnxruntime-genai model (genai_config.json)
    has its own, which a smaller value here lowers (0: the model's)."""
    eos_token_ids: list[int] = Field(default_factory=list)
    """Tokens that end a completion (finish reason `stop`); they are not part of the text. An
    onnxruntime-genai model's come from its genai_config.json."""
    kv_cache_bytes: int = Field(256 << 20, gt=0)
    """Bytes of key/value cache all running sequences may hold together; a sequence reserves
    its prompt plus max_tokens at admission and waits while that does not fit."""
    max_running_sequences: int = Field(32, gt=0, le=4096)
    """Sequences decoded together in one step (the decode batch)."""
    max_waiting_sequences: int = Field(256, ge=0)
    """Sequences that may wait for cache room; past it a new one is refused with 503."""
    prefill_chunk_tokens: int = Field(256, gt=0)
    """Prompt tokens prefilled per scheduler step, so a long prompt is spread over several
    steps and running streams keep getting a token every step."""
    prefix_caching: bool = True
    """Keep the keys/values of prompt prefixes (within kv_cache_bytes, evicted first when a
    sequence needs room) so prompts that start the same way skip prefilling that part."""
    prefix_block_tokens: int = Field(16, gt=0, le=4096)
    """Tokens per prefix-cache block: a prompt reuses whole blocks of an earlier one."""
    default_max_tokens: int = Field(16, gt=0)
    """Completion tokens when a request sets no max_tokens (clamped to the context). An
    onnxruntime-genai model's default is the rest of the context, as OpenAI's API and vLLM's."""
