"""The control channel between a worker process and the engine process: a unix stream socket
carrying frames of `<u32 length><u8 kind><JSON payload>`. Tensors never travel here, only their
descriptors (shm/layout.py); the payload is orjson, never pickle, and a frame larger than
MAX_FRAME_BYTES or a kind that is not known ends the connection.

Generation (engine/generation/service.py) is a GENERATE request answered by STREAM once it is
admitted, then one TOKENS frame per chunk the scheduler gives, the last with its finish reason;
an ERROR with the same id refuses it or ends it, and the worker's CANCEL (its client left)
frees the sequence's slot at the next step. Tokens are small: they travel in the frames."""

from __future__ import annotations

import enum
import struct
from typing import Any

import orjson

from engine import errors

HEADER = struct.Struct("<IB")
MAX_FRAME_BYTES = 64 * 1024 * 1024


class Kind(enum.IntEnum):
    """What a frame is. Worker -> engine: HELLO, INFER, CANCEL, FREE_OUT, CALL, EVENTS,
    GENERATE. Engine -> worker: WELCOME, RESULT, ERROR, FREE_IN, REPLY, STATE, STREAM, TOKENS."""

    HELLO = 1  # {"worker": index, "pid": pid}
    INFER = 2  # [request...], each [id, slot, size, [descriptor...], ...]: see INFER_ITEMS
    CANCEL = 3  # {"id"}
    FREE_OUT = 4  # {"slots": [offset...]}: the worker is done with these answers
    CALL = 5  # {"id", "method", "args"}: everything but inference
    EVENTS = 6  # {"requests": [[model, version, protocol, status, seconds]...], "encoded": ...}
    GENERATE = 7  # {"id", "request": GenerateRequest.to_wire(), "request_id"}
    WELCOME = 11  # {"held": [[offset, nbytes]...], "state": {...}}
    RESULT = 12  # [answer...], each [id, slot, size, [descriptor...], ...]: see RESULT_ITEMS
    ERROR = 13  # {"id", "error": class, "message", "retry_after_s", "headers", param, tokens}
    FREE_IN = 14  # {"slots": [offset...]}: the engine no longer reads these requests' inputs
    REPLY = 15  # {"id", "result"}
    STATE = 16  # {"draining", "models", "generative": [model...], "generation", "server"}
    STREAM = 17  # {"id", "headers", "prompt_tokens"}: the generation is admitted
    TOKENS = 18  # {"id", "tokens", "text", "finish_reason", "completion_tokens"}


INFER_ITEMS = 18
"""An INFER frame is a list of requests, every one a side sends in a flush (a frame
each cost ~0.4 µs a request to frame, split and dispatch), each request itself a list, not an
object (keys cost ~0.5 µs a request to write and to read): `[id, slot, size, [descriptor...],
model_name, datatypes, model_version, the request's id, outputs, parameters, priority,
timeout_s, arrived, tenant, request_id, trace, checked_version, rows]`, the in-slot and the
descriptors its inputs (shm/layout.py), then the InferRequest's fields, the worker's request_id
(the engine's log lines name it too) and traceparent (None when not traced), then what the
worker's input check established: the engine's id of the model version whose inputs it checked
the declared shapes against (host_control.py `HostControl.version_id`) and the rows it
returned, both None when it ran no model check (`unchecked`: an on_demand model never loaded).
The engine trusts them only while that version serves the request (host.py `_infer`)."""

RESULT_ITEMS = 9
"""A RESULT frame is a list of answers likewise, each `[id, slot, size, [descriptor...],
model_name, model_version, datatypes, the response's id, parameters]`, the out-slot and the
descriptors of the outputs in it, then the InferResponse's fields."""


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def error_payload(call_id: int, exc: errors.EngineError) -> dict[str, Any]:
    """An ERROR frame's payload: what the worker needs to raise the same error again."""
    return {
        "id": call_id,
        "error": type(exc).__name__,
        "message": exc.message,
        "retry_after_s": exc.retry_after_s,
        "headers": dict(exc.headers),
        "param": exc.param,
        "tokens": isinstance(exc, errors.RateLimited) and exc.tokens,
    }


def frame(kind: Kind, payload: Any) -> bytes:
    body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    return HEADER.pack(len(body), kind) + body


def list_frames(kind: Kind, items: list[bytes]) -> list[bytes]:
    """Frames of `kind` whose payloads are lists of `items`, each an encoded JSON value of at
    most MAX_FRAME_BYTES - 2 (the list's brackets fill the rest), joined as they are (nothing is
    encoded again); one frame unless together they pass MAX_FRAME_BYTES."""
    body = b"[%b]" % b",".join(items)
    if len(body) <= MAX_FRAME_BYTES:
        return [HEADER.pack(len(body), kind) + body]
    frames: list[bytes] = []
    start, size = 0, 1  # size: the body's, were items[start:index] framed together
    for index, item in enumerate(items):
        if index > start and size + len(item) + 1 > MAX_FRAME_BYTES:
            frames += list_frames(kind, items[start:index])
            start, size = index, 1
        size += len(item) + 1
    return frames + list_frames(kind, items[start:])


class Outbox:
    """The frames waiting for a side's next write. `items` gathers the encoded items of one list
    frame of `kind` (the requests or answers of a loop iteration); a frame added later goes after
    them, so a CANCEL never overtakes its request."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.items: list[bytes] = []
        self._frames: list[bytes] = []

    def add(self, data: bytes) -> None:
        """Queue a whole frame, after the items gathered so far."""
        self._frame_items()
        self._frames.append(data)

    def take(self) -> bytes:
        """Everything queued, framed and joined for one write; the outbox is empty after."""
        self._frame_items()
        data = b"".join(self._frames)
        self._frames.clear()
        return data

    def _frame_items(self) -> None:
        if self.items:
            self._frames += list_frames(self.kind, self.items)
            self.items = []


_KINDS = {kind.value: kind for kind in Kind}  # a dict lookup: Kind(value) costs ~1 µs a frame


class FrameBuffer:
    """Splits a byte stream into frames (for an asyncio.Protocol's data_received: one call
    parses every frame that arrived together, with no task switch per frame). Frames are
    parsed where they lie, in `data` itself unless a partial frame was left over from the last
    call: only that remainder is kept, and nothing is copied per frame."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[Kind, Any]]:
        buf = self._buf
        if buf:
            buf += data
        source = buf if buf else data
        frames: list[tuple[Kind, Any]] = []
        at, end = 0, len(source)
        header = HEADER.size
        unpack = HEADER.unpack_from
        with memoryview(source) as view:
            while end - at >= header:
                size, kind = unpack(view, at)
                if size > MAX_FRAME_BYTES:
                    raise ProtocolError(
                        f"frame of {size} bytes passes the {MAX_FRAME_BYTES} byte limit"
                    )
                stop = at + header + size
                if stop > end:
                    break
                # _parse, inline: a call less a frame.
                known = _KINDS.get(kind)
                if known is None:
                    raise ProtocolError(f"bad frame (kind {kind}, {size} bytes): no such kind")
                with view[at + header : stop] as body:  # released before buf is resized
                    try:
                        frames.append((known, orjson.loads(body)))
                    except orjson.JSONDecodeError as exc:
                        raise ProtocolError(
                            f"bad frame (kind {kind}, {size} bytes): {exc}"
                        ) from exc
                at = stop
            if source is data:
                buf += view[at:]  # the start of a frame that has not all arrived
        if source is buf:
            del buf[:at]
        return frames
