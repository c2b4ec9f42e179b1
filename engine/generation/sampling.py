"""Per-request sampling: greedy, temperature, top-k, top-p, a seed, stop strings, max_tokens,
and guided decoding (a grammar the output must match; onnxruntime-genai models only).
Parameters are checked once when the request arrives (a value out of range is a 400 naming the
parameter, what was received and what is allowed); each sequence then samples with its own
numpy Generator, so a seeded request gives the same tokens whatever else runs beside it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.datatypes import past_64_bits, received, shown
from engine.errors import InvalidInput

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1000
"""The longest stop string: each token's text is searched for it in as much text as it is long,
so a stop string of megabytes (a body may hold one) cost every token as much, on the event
loop."""
MAX_SEED = 2**63 - 1
GUIDANCE_KINDS = ("json_schema", "regex", "lark_grammar")
"""The grammars onnxruntime-genai's guided decoding (llguidance) takes."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 is greedy (argmax)."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    guidance: tuple[str, str] | None = None  # (one of GUIDANCE_KINDS, the grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _number(name: str, value: object, low: float, high: float, integer: bool = False) -> None:
    if integer and past_64_bits(value):  # as JSON hands one over: out of range, not a fraction
        raise InvalidInput(f"{name} must be from {low} to {high}; got {shown(value)}", name)
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        raise InvalidInput(
            f"{name} must be {kind} from {low} to {high}; got {received(value)}", name
        )
    assert isinstance(value, int | float)
    if not low <= value <= high:
        raise InvalidInput(f"{name} must be from {low} to {high}; got {value}", name)


def check_max_tokens(value: object, name: str = "max_tokens") -> None:
    """InvalidInput unless `value` is a token count the scheduler takes (`name`: the field the
    client used; OpenAI's max_completion_tokens means max_tokens)."""
    _number(name, value, 1, 2**31 - 1, integer=True)


def sampling_params(
    max_tokens: object,
    temperature: object = 1.0,
    top_k: object = 0,
    top_p: object = 1.0,
    seed: object = None,
    stop: object = None,
    guidance: object = None,
) -> SamplingParams:
    """Checked parameters (InvalidInput names the first one out of range). `max_tokens` is
    checked for sign only: the scheduler clamps it to the context."""
    check_max_tokens(max_tokens)
    _number("temperature", temperature, 0, 2)
    _number("top_k", top_k, 0, 2**31 - 1, integer=True)
    _number("top_p", top_p, 0, 1)
    if top_p == 0:
        raise InvalidInput("top_p must be above 0 and at most 1; got 0", "top_p")
    if seed is not None:
        _number("seed", seed, 0, MAX_SEED, integer=True)
    stops: tuple[str, ...]
    if stop is None:
        stops = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise InvalidInput(
            f"stop must be a string or a list of strings; got {received(stop)}", "stop"
        )
    if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise InvalidInput(
            f"stop takes 1 to {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters; "
            f"got {received(list(stops))}",
            "stop",
        )
    if guidance is not None and not (
        isinstance(guidance, list | tuple)
        and len(guidance) == 2
        and guidance[0] in GUIDANCE_KINDS
        and isinstance(guidance[1], str)
    ):
        raise InvalidInput(
            f"guidance must be [kind, grammar] with kind one of {', '.join(GUIDANCE_KINDS)}; "
            f"got {received(guidance)}",
            "guidance",
        )
    return SamplingParams(
        max_tokens=int(max_tokens),  # type: ignore[call-overload]
        temperature=float(temperature),  # type: ignore[arg-type]
        top_k=int(top_k),  # type: ignore[call-overload]
        top_p=float(top_p),  # type: ignore[arg-type]
        seed=None if seed is None else int(seed),  # type: ignore[call-overload]
        stop=stops,
        guidance=None if guidance is None else (str(guidance[0]), str(guidance[1])),
    )


class Sampler:
    """Picks the next token from one row of logits."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        params = self.params
        if params.greedy:
            return int(np.argmax(logits))
        # Shifted to a maximum of 0 first: a tiny temperature then sends the others to -inf
        # instead of sending the largest to +inf (and inf - inf to NaN).
        scores = logits.astype(np.float64)
        with np.errstate(over="ignore"):
            scores = (scores - scores.max()) / params.temperature
        if 0 < params.top_k < scores.size:
            kth = np.partition(scores, -params.top_k)[-params.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        if params.top_p < 1.0:
            order = np.argsort(-probs)
            cumulative = np.cumsum(probs[order])
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        return int(self._rng.choice(probs.size, p=probs))
