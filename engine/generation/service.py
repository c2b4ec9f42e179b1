"""Generation as the front-ends ask for it: `GenerationService.generate` resolves the model,
checks the sampling parameters, tokenizes the prompt, admits the request (one request, or with
`unit: tokens` the prompt plus every token it may generate) and queues its sequence; the
`TokenStream` it returns yields the chunks and, when the stream ends, gives the limiter back the
tokens charged but not generated (a stop string, the end-of-text token, a cancel).

The in-process front-ends call the service directly. Under `--workers N` a worker sends the same
`GenerateRequest` over its control socket (server/link/remote.py) and the engine process serves it
with this class (server/link/host.py): one implementation, and the scheduler, the key/value cache
and the limiter stay the engine's. Authentication is the front-end's (the request carries the
tenant it authenticated)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.datatypes import past_64_bits, received, shown
from engine.errors import EngineError, InvalidInput, ModelNotFound
from engine.generation.context import completion_budget
from engine.generation.generator import TextGenerator
from engine.generation.sampling import SamplingParams, sampling_params
from engine.generation.sequence import Chunk, GenSequence
from engine.limits import Limiter
from engine.limits.limiter import Admission
from engine.model import LoadedModel
from engine.registry import ModelRegistry

ANONYMOUS = "anonymous"
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
GUIDANCE = "guidance"
"""An option key beside SAMPLING_KEYS: [kind, grammar] for guided decoding (sampling.py)."""
TOOLS = "tools"
"""An option key of a chat: the tools its template renders (OpenAI's `tools` list)."""


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation as a front-end parsed it. Exactly one of `prompt` (text or token ids)
    and `messages` (a chat, rendered with the model's template) is set; `options` holds the
    sampling keys given (SAMPLING_KEYS; max_tokens absent takes the model's default, clamped to
    what the context leaves), and GUIDANCE and TOOLS when asked for. `refuse_past_context`: a
    max_tokens given that the context cannot hold after the prompt is refused (OpenAI's API),
    not clamped (Triton's generate extension); see engine/generation/context.py."""

    model: str
    tenant: str | None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    refuse_past_context: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tenant": self.tenant,
            "prompt": self.prompt,
            "messages": self.messages,
            "options": self.options,
            "refuse_past_context": self.refuse_past_context,
        }

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> GenerateRequest:
        """The request a worker sent (server/link/frames.py GENERATE); a field of the wrong type is
        a TypeError (the connection's protocol error), never a crash further in."""
        model, tenant = message["model"], message.get("tenant")
        prompt, messages = message.get("prompt"), message.get("messages")
        options = message.get("options") or {}
        refuse = message.get("refuse_past_context", False)
        if not isinstance(refuse, bool):
            raise TypeError("GENERATE: refuse_past_context must be true or false")
        if not isinstance(model, str) or not (tenant is None or isinstance(tenant, str)):
            raise TypeError("GENERATE: model and tenant must be strings")
        if not (prompt is None or isinstance(prompt, str | list)):
            raise TypeError("GENERATE: prompt must be text or a list")
        if not (messages is None or isinstance(messages, list)) or not isinstance(options, dict):
            raise TypeError("GENERATE: messages must be a list and options an object")
        return cls(model, tenant, prompt, messages, options, refuse)


class TokenStream(Protocol):
    """An admitted generation, as the routes answer it (in-process `LocalStream`, or a worker's
    relay of one, server/link/remote.py)."""

    @property
    def headers(self) -> dict[str, str]:
        """The admission's X-RateLimit-* headers."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far (the final count once the stream ended)."""

    @property
    def finish_reason(self) -> str | None: ...

    def chunks(self) -> AsyncIterator[Chunk]:
        """Chunks until the one with a finish reason (included); leaving early cancels."""

    def cancel(self) -> None:
        """The client is gone: the sequence's cache slot is freed at the next step."""


class Generation(Protocol):
    """What the generation routes call: this module's service, or a worker's relay to it."""

    def generative_models(self) -> list[str]:
        """The names of the models served by the generation scheduler."""

    async def generate(self, request: GenerateRequest) -> TokenStream:
        """Admit and queue `request`, or raise the EngineError saying why not."""


class GenerativeEngine(Protocol):
    """What the service uses of the in-process engine (`engine.engine.Engine`)."""

    @property
    def registry(self) -> ModelRegistry: ...
    @property
    def limiter(self) -> Limiter: ...


class GenerationService:
    """Generation over the engine's generative models (see the module docstring)."""

    def __init__(self, engine: GenerativeEngine) -> None:
        self._engine = engine
        self._settling: set[asyncio.Task[None]] = set()

    def generative_models(self) -> list[str]:
        registry = self._engine.registry
        names = {m.name for m in registry.all() if m.generator is not None}
        if registry.on_demand is not None:  # and those a request would load
            names |= registry.on_demand.generative
        return sorted(names)

    async def generate(self, request: GenerateRequest) -> LocalStream:
        """Draining is the data plane's to refuse (server/generating.py): a request it let in
        is served, as for inference."""
        engine = self._engine
        registry, on_demand = engine.registry, engine.registry.on_demand
        if on_demand is None:
            return await self._generate(registry.resolve(request.model, None), request, None)
        # on_demand: a generative model not resident is loaded (bounded as any load), and the
        # stream holds it from here to its end, so it is never evicted under a sequence.
        admitted = None
        if not registry.has(request.model):
            if not on_demand.is_generative(request.model):
                raise ModelNotFound(request.model, available=self.generative_models())
            if engine.limiter.unit != "tokens":
                # A request its tenant may not send now never loads a model, as for inference.
                # (Counted in tokens, it is admitted once loaded: its tokenizer counts them.)
                tenant = request.tenant or ANONYMOUS
                admitted = await engine.limiter.admit(tenant, request.model, 1)
        wait_s = registry.settings.model_memory.load_wait_s
        try:
            model = await registry.acquire(request.model, None, wait_s)
        except BaseException as exc:
            await _refused(admitted, exc)
            raise
        release = on_demand.hold(model.name)
        try:
            return await self._generate(model, request, release, admitted)
        except BaseException:
            release()
            raise

    async def _generate(
        self,
        model: LoadedModel,
        request: GenerateRequest,
        release: Callable[[], None] | None = None,
        admitted: Admission | None = None,
    ) -> LocalStream:
        """Check, admit (unless `admitted` before its model loaded) and start a sequence."""
        try:
            generator, prompt, params, tokens = await self._checked(model, request)
        except BaseException as exc:
            await _refused(admitted, exc)
            raise
        engine = self._engine
        in_tokens = engine.limiter.unit == "tokens"
        cost = tokens if in_tokens else 1
        tenant = request.tenant or ANONYMOUS
        admission = admitted or await engine.limiter.admit(tenant, request.model, cost)
        try:
            sequence = generator.start(prompt, params)
        except BaseException:
            admission.release()
            if in_tokens:
                await admission.refund(admission.charged)  # refused: no token was used
            raise
        return LocalStream(
            generator, sequence, admission, self._spawn if in_tokens else None, release
        )

    async def _checked(
        self, model: LoadedModel, request: GenerateRequest
    ) -> tuple[TextGenerator, list[int], SamplingParams, int]:
        """The request's generator, prompt, sampling and tokens (prompt + completion), or the
        EngineError refusing it (before admission: a refusal charges nothing)."""
        generator = model.generator
        if generator is None:
            raise ModelNotFound(request.model, available=self.generative_models())
        # A key given as null is a key not given: it takes the default.
        keys = (*SAMPLING_KEYS, GUIDANCE)
        options = {k: v for k, v in request.options.items() if k in keys and v is not None}
        if GUIDANCE in options and not generator.guided:
            raise InvalidInput(
                f"{request.model}: guided decoding (response_format, tools) is not supported by "
                "this model; it needs an onnxruntime-genai model",
                GUIDANCE,
            )
        requested = "max_tokens" in options
        options.setdefault("max_tokens", generator.options.default_max_tokens)
        params = sampling_params(**options)
        chat = request.messages is not None
        if request.messages is not None:
            prompt = await generator.chat_ids(request.messages, request.options.get(TOOLS))
        else:
            prompt = await prompt_ids(generator, request.prompt)
        # Refused here, before admission: a refusal charges no tokens.
        completion = completion_budget(
            len(prompt),
            params.max_tokens,
            generator.options.context_length,
            requested=requested and request.refuse_past_context,
            chat=chat,
        )
        return generator, prompt, params, len(prompt) + completion

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)


async def _refused(admitted: Admission | None, exc: BaseException) -> None:
    """A request admitted before its model loaded, refused before it ran: its slots go back,
    and its charge too unless it was cancelled (as for inference, engine/engine.py)."""
    if admitted is not None:
        admitted.release()
        if isinstance(exc, EngineError):
            await admitted.refund(admitted.charged)


async def prompt_ids(generator: TextGenerator, prompt: object) -> list[int]:
    """The token ids of a prompt given as text or as ids (each checked against the vocabulary);
    InvalidInput for anything else."""
    if isinstance(prompt, str):
        return await generator.prompt_ids(prompt)
    # An id past 64 bits comes as a double (as JSON hands it over): out of the vocabulary.
    if isinstance(prompt, list) and all(type(t) is int or past_64_bits(t) for t in prompt):
        vocab = generator.text.tokenizer.get_vocab_size()
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidInput(
                f"prompt token {shown(bad[0])} is not in the vocabulary (0 to {vocab - 1})",
                "prompt",
            )
        return list(prompt)
    raise InvalidInput(
        "prompt must be a string or a list of token ids (one prompt per request); "
        f"got {received(prompt)}",
        "prompt",
    )


class LocalStream:
    """A sequence of this process's scheduler and its admission. When it ends the admission's
    slots are released and, when `spawn` is given (`unit: tokens`), the charge not used
    (prompt + generated tokens) is refunded: before the final chunk is handed on (a client
    that has seen the end may count on it), or in a task `spawn` keeps when cancelled. With
    `release`, it is called then too (the model's hold, on_demand)."""

    def __init__(
        self,
        generator: TextGenerator,
        sequence: GenSequence,
        admission: Admission,
        spawn: Callable[[Coroutine[Any, Any, None]], None] | None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self._generator = generator
        self._release = release
        self._sequence = sequence
        self._admission = admission
        self._spawn = spawn
        self._settled = False

    @property
    def headers(self) -> dict[str, str]:
        return self._admission.headers

    @property
    def prompt_tokens(self) -> int:
        return len(self._sequence.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self._sequence.generated)

    @property
    def finish_reason(self) -> str | None:
        return self._sequence.finish_reason

    @property
    def sequence(self) -> GenSequence:
        return self._sequence

    async def chunks(self) -> AsyncIterator[Chunk]:
        try:
            async for chunk in self._sequence.stream():
                if chunk.finish_reason is not None:
                    refund = self._settle()
                    if refund is not None:
                        await refund
                yield chunk
        finally:
            self.cancel()

    def cancel(self) -> None:
        self._generator.cancel(self._sequence)  # a no-op once finished
        refund = self._settle()
        if refund is not None and self._spawn is not None:
            self._spawn(refund)

    def _settle(self) -> Coroutine[Any, Any, None] | None:
        """Release the admission's slots (once); the refund of the unused charge to run."""
        if self._settled:
            return None
        self._settled = True
        if self._release is not None:
            self._release()
        admission = self._admission
        admission.release()
        if self._spawn is None:
            return None
        used = len(self._sequence.prompt) + len(self._sequence.generated)
        return admission.refund(admission.charged - used)
