"""Tensors in client shared memory, for the data plane: the inputs a request names in its
tenant's regions read into it before the engine sees it, and the outputs it asks for there written
once answered. The regions and their checks are engine/regions.py (CUDA ones: its `cuda`,
engine/cuda_regions.py, copied to and from the device); this is the conversion
between their bytes and tensors in the raw layout both transports share (server/raw_tensors.py).

Every size is checked before a byte is read: an input's `shared_memory_byte_size` against its
declared shape and datatype (a fixed-size one must match exactly), all of a request's inputs
together against `max_request_bytes` (as a body would be), and each against its region (the
registry). Reads and writes of more than raw_tensors.OFFLOAD_BYTES run in a worker thread."""

from __future__ import annotations

import dataclasses

from engine.errors import InvalidInput, PayloadTooLarge
from engine.regions import SystemRegions
from engine.types import InferRequest, InferResponse
from server.raw_tensors import fixed_bytes, off_loop, tensor_buffer, tensor_from_buffer


async def read_inputs(
    regions: SystemRegions, tenant: str, request: InferRequest, limit: int
) -> None:
    """Read `request.shared_inputs` from `tenant`'s regions into the request's inputs."""
    shared = request.shared_inputs or {}
    regions.require_enabled()
    total = 0
    for name, ref in shared.items():
        needed = fixed_bytes(request.datatypes[name], ref.shape)
        if needed is not None and ref.byte_size != needed:  # BYTES: checked as it is decoded
            raise InvalidInput(
                f"input '{name}' has shape {list(ref.shape)} of {request.datatypes[name]} "
                f"({needed} bytes) but shared_memory_byte_size {ref.byte_size}"
            )
        total += ref.byte_size
    if total > limit:
        raise PayloadTooLarge(total, limit)

    def read() -> None:
        for name, ref in shared.items():
            raw = regions.read(tenant, ref, f"input '{name}'")
            request.inputs[name] = tensor_from_buffer(
                memoryview(raw), request.datatypes[name], ref.shape, name, shape_checked=True
            )

    await off_loop(total, read)


async def write_outputs(
    regions: SystemRegions, tenant: str, request: InferRequest, response: InferResponse
) -> InferResponse:
    """Write the outputs `request.shared_outputs` names into `tenant`'s regions; the answer
    says which went there (a copy: a cached or coalesced response is not changed)."""
    shared = request.shared_outputs or {}
    regions.require_enabled()
    written = {name: ref for name, ref in shared.items() if name in response.outputs}
    size = sum(response.outputs[name].nbytes for name in written)

    def write() -> None:
        for name, ref in written.items():
            data = tensor_buffer(response.outputs[name], response.datatypes[name])
            regions.write(tenant, ref, memoryview(data), f"output '{name}'")

    await off_loop(size, write)
    return dataclasses.replace(response, shared_outputs=written)
