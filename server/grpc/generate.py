"""Generation over gRPC `ModelStreamInfer`, decoupled as Triton's LLM backends are: a request to a
generative model (input `text_input`, BYTES [1]; sampling in the request's parameters:
max_tokens, temperature, top_k, top_p, seed, stop) gets one ModelInferResponse per token batch,
each with the new text as `text_output` (BYTES [1]); the last has the parameters
`triton_final_response: true`, `finish_reason` and the token counts; with the request parameter
`triton_enable_empty_final_response` (tritonclient's `enable_empty_final_response=True`) those
come on a last response of their own, without outputs, as Triton sends them. A failure is one
`error_message` answer naming its request (`stream_error`), as for any stream request. This
module only converts: the data plane (server/dataplane.py) authenticates, authorizes and calls
the engine's generation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import numpy as np

from engine.errors import EngineError, InvalidInput
from engine.generation.service import SAMPLING_KEYS, GenerateRequest
from engine.types import InferResponse
from engine.validate import scheduling
from server.dataplane import DataPlane
from server.generating import GenerationRoute
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.tensors import decode_request, encode_response

Metadata = Iterable[tuple[str, str | bytes]]
STREAM_SPAN = "inference.GRPCInferenceService/ModelStreamInfer"
EMPTY_FINAL = "triton_enable_empty_final_response"


def _text(request: pb.ModelInferRequest) -> str:
    decoded = decode_request(request)
    if decoded.shared_inputs:
        raise InvalidInput(
            "a generative model takes its text_input in the request, not in shared memory"
        )
    text = decoded.inputs.get("text_input")
    if (
        text is None
        or len(decoded.inputs) != 1
        or decoded.datatypes.get("text_input") != "BYTES"
        or text.size != 1
    ):
        got = [f"{n} {decoded.datatypes[n]} {list(a.shape)}" for n, a in decoded.inputs.items()]
        raise InvalidInput(
            "a generative model takes one input 'text_input' BYTES [1]; got "
            + (", ".join(got) or "no input")
        )
    value = text.reshape(-1)[0]
    try:
        return value.decode() if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"text_input is not UTF-8: {exc}") from exc


def _triton_options(options: dict[str, object]) -> bool:
    """Take the Triton parameters tritonclient sends out of `options`: `priority` (checked; the
    generation scheduler serves in arrival order, as Triton's schedulers other than the dynamic
    batcher do) and `triton_enable_empty_final_response`, returned."""
    scheduling({"priority": options.pop("priority", 0)})
    empty_final = options.pop(EMPTY_FINAL, False)
    if not isinstance(empty_final, bool):
        raise InvalidInput(f"{EMPTY_FINAL} must be a bool; got {empty_final!r}")
    return empty_final


def _answer(
    request: pb.ModelInferRequest, text: str | None, parameters: dict[str, object]
) -> pb.ModelStreamInferResponse:
    outputs = {} if text is None else {"text_output": np.array([text.encode()], dtype=object)}
    response = InferResponse(
        model_name=request.model_name,
        model_version=request.model_version,
        outputs=outputs,
        datatypes={name: "BYTES" for name in outputs},
        id=request.id or None,
        parameters=parameters,
    )
    return pb.ModelStreamInferResponse(infer_response=encode_response(response))


def stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    """The answer to a stream's request that failed with `message`: its model and `id` are
    named, so that a client matches it to its request as it does the others."""
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )


async def stream_generation(
    plane: DataPlane, request: pb.ModelInferRequest, metadata: Metadata
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """The answers to one generation request on a stream (never raises an EngineError); its
    model is one of `plane.generative_models()`."""
    headers = {str(k): v if isinstance(v, str) else v.decode("latin-1") for k, v in metadata}
    access = f"gRPC ModelStreamInfer {request.model_name}"
    try:
        call = plane.generation_call(GenerationRoute("grpc", STREAM_SPAN, access, headers))
        with call.reading():
            call.choose(request.model_name)
            options = {k: v for k, v in decode_request(request).parameters.items() if v is not None}
            empty_final = _triton_options(options)
            unknown = sorted(set(options) - set(SAMPLING_KEYS))
            if unknown:
                raise InvalidInput(
                    f"unknown generation parameter '{unknown[0]}'; allowed: "
                    + ", ".join(SAMPLING_KEYS)
                )
            text = _text(request)
        generate = GenerateRequest(request.model_name, call.tenant, text, None, options)
        [tokens] = await call.start([generate])
    except EngineError as exc:
        yield stream_error(request, exc.message)
        return
    try:
        async for chunk in tokens.chunks():
            if chunk.error is not None:
                yield stream_error(request, chunk.error.message)
                return
            if chunk.finish_reason is None:
                if chunk.text:
                    yield _answer(request, chunk.text, {"triton_final_response": False})
                continue
            final: dict[str, object] = {
                "triton_final_response": True,
                "finish_reason": chunk.finish_reason,
                "prompt_tokens": tokens.prompt_tokens,
                "completion_tokens": tokens.completion_tokens,
            }
            if not empty_final:
                yield _answer(request, chunk.text, final)
                continue
            if chunk.text:  # the final flag then comes alone, on a response without outputs
                yield _answer(request, chunk.text, {"triton_final_response": False})
            yield _answer(request, None, final)
    finally:
        tokens.cancel()  # the client went away: free the slot at the next step
