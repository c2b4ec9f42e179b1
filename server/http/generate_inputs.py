"""The fields of a Triton generate request (`/v2/models/{m}/generate[_stream]`) as the clients of
Triton's LLM backends send them, read into sluice's sampling options.

Triton's generate extension turns each top-level JSON field into an input tensor of the model, so
a field holds a scalar or a list (a tensor of shape [1] is `16` or `[16]`), and `parameters`
holds request parameters. TensorRT-LLM's ensemble takes `max_tokens`, `temperature`, `top_k`,
`top_p`, `random_seed`, `stop_words`, `bad_words`, `end_id`, `pad_id`, `beam_width`, the
`return_*` flags and `exclude_input_in_output`; vLLM's backend takes `sampling_parameters` (a
JSON string of its SamplingParams) and `stream`, and reads `parameters` too. Here:

- the sampling keys (SAMPLING_KEYS) and their TensorRT-LLM names (ALIASES) are honoured, from the
  top level, `parameters` or `sampling_parameters`;
- fields that ask for nothing sluice does not do are accepted (NEUTRAL: empty `bad_words`,
  `beam_width` 1, `return_log_probs` false, penalties at their neutral value, ...), and so are
  those sluice answers anyway or that do not change the answer (IGNORED: the stream flag, which
  the route decides; `return_finish_reason` and the token counts, always sent; `pad_id`;
  `end_id`, since generation ends at the model's own end-of-text token);
- any other value of those is a 400 saying what sluice does instead, and an unknown field is a
  400 naming it, as Triton refuses an input the model does not have."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from engine.datatypes import received
from engine.errors import InvalidInput
from engine.generation.service import SAMPLING_KEYS

ALIASES = {"random_seed": "seed", "stop_words": "stop", "runtime_top_k": "top_k",
           "runtime_top_p": "top_p"}  # fmt: skip
"""TensorRT-LLM's names of sluice's sampling keys."""

NEUTRAL: dict[str, tuple[object, ...]] = {
    "bad_words": ("",),
    "beam_width": (1,),
    "num_return_sequences": (1,),
    "n": (1,),
    "return_log_probs": (False,),
    "return_context_logits": (False,),
    "return_generation_logits": (False,),
    "return_logprobs": (False,),
    "return_cumulative_logprob": (False,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "min_length": (0, 1),
    "min_tokens": (0,),
    "exclude_input_in_output": (True,),
}
"""Fields sluice does not implement, with the values that ask for nothing (anything else is a 400:
`text_output` never repeats the prompt, one sequence per request, no log probabilities, no
penalties)."""

IGNORED = (
    "stream",
    "end_id",
    "pad_id",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
"""Fields accepted with any value: the route decides streaming, the finish reason and the token
counts are always answered, padding does not change the answer, and generation ends at the
model's own end-of-text token."""

__all__ = ["generate_request"]


def generate_request(body: Any) -> tuple[str, dict[str, Any]]:
    """(text_input, sampling options) of a generate request's JSON body."""
    if not isinstance(body, dict):
        raise InvalidInput(f"the request body must be a JSON object; got {received(body)}")
    text = _scalar("text_input", body.get("text_input"))
    if not isinstance(text, str):
        raise InvalidInput(f"text_input must be a string; got {received(body.get('text_input'))}")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput(f"parameters must be an object; got {received(parameters)}")
    options: dict[str, Any] = {}
    top = {k: v for k, v in body.items() if k not in ("text_input", "parameters")}
    vllm = top.pop("sampling_parameters", None)
    # Later sources win where a key comes twice: top level, then sampling_parameters, then
    # parameters (as Triton's own precedence for request parameters over inputs).
    _read(top, "field", options)
    if vllm is not None:
        _read(_sampling_parameters(vllm), "sampling_parameters key", options)
    _read(parameters, "parameter", options)
    return text, options


def _read(fields: Mapping[str, Any], what: str, options: dict[str, Any]) -> None:
    for name, raw in fields.items():
        key = ALIASES.get(name, name)
        if key in SAMPLING_KEYS:
            options[key] = _stops(name, raw) if key == "stop" else _scalar(name, raw)
        elif name in NEUTRAL:
            if not _neutral(name, raw):
                allowed = " or ".join(received(n) for n in NEUTRAL[name])
                raise InvalidInput(
                    f"{name} is not supported by this server (it answers one sequence of the "
                    "generated text only, without log probabilities or penalties): it may be "
                    f"{allowed}; got {received(raw)}",
                    name,
                )
        elif name not in IGNORED:
            allowed = ", ".join([*SAMPLING_KEYS, *ALIASES])
            raise InvalidInput(f"unknown generate {what} '{name}'; the sampling keys are {allowed}")


def _neutral(name: str, raw: Any) -> bool:
    """Whether field `name` asks for nothing: a neutral value as a bool or number (1.0 is 1, a
    bool is not a number), or no bad words."""
    if name == "bad_words":
        return _words(raw) == []
    value = _scalar(name, raw)
    for neutral in NEUTRAL[name]:
        if isinstance(neutral, bool) or isinstance(value, bool):
            if value is neutral:
                return True
        elif isinstance(value, int | float) and value == neutral:
            return True
    return False


def _scalar(name: str, value: Any) -> Any:
    """A tensor of one element as its element: `[16]` is 16."""
    if isinstance(value, list):
        if len(value) != 1:
            raise InvalidInput(
                f"{name} must be one value (or a list of one); got {received(value)}"
            )
        return value[0]
    return value


def _words(value: Any) -> list[Any] | None:
    """TensorRT-LLM's word lists: a string or a list of strings, "" for none."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if v != ""]
    return None


def _stops(name: str, value: Any) -> Any:
    words = _words(value)
    if words is None:
        return value  # refused by the sampling check, named as sent
    return words or None


def _sampling_parameters(value: Any) -> dict[str, Any]:
    """vLLM's `sampling_parameters`: a JSON object, sent as a string (a BYTES tensor)."""
    value = _scalar("sampling_parameters", value)
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"sampling_parameters is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidInput(
            f"sampling_parameters must be a JSON object (or a string of one); got {received(value)}"
        )
    return value
