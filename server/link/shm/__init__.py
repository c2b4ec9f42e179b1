"""The shared-memory arenas that carry tensors between a worker process and the engine process.

Each worker has two arenas, anonymous memory files (memfd) created by the supervisor before it
forks the engine and the workers, so both sides map the same pages and nothing is left behind in
/dev/shm when a process dies:

    in-arena   the worker allocates a slot per request and writes the decoded inputs into it once;
               the engine views them in place (np.ndarray over the mapping) and the batcher's
               concatenation reads them from there. The engine says when a slot is free again:
               when the last array viewing it is gone, not when the answer is sent (a batch
               still running may read a cancelled request's inputs).
    out-arena  the engine allocates a slot per answer and writes the outputs into it once; the
               worker views them in place while it encodes the response, then frees the slot.

A slot holds its tensors back to back, each at a 64-byte aligned offset. A numeric tensor is its
C-contiguous bytes; a BYTES tensor is Triton's layout (a 4-byte little-endian length before each
element), decoded back into a numpy object array on the other side (the only copy: Python bytes
objects cannot live in shared memory). The descriptors that say where each tensor lies travel in
the control message (frames.py), never the data.

Bounds: an arena is `workers_arena_bytes` (per worker, per direction). A request whose inputs do
not fit in the free space is answered Overloaded (503 with Retry-After) at once; one that could
never fit is PayloadTooLarge (413); no request ever waits for space.

The modules: `arena` (an arena's mapping, its slots' buffers, and the watcher that says when
the last array viewing a slot is gone), `allocator` (which slots of an arena are taken),
`layout` (how tensors lie in a slot, and the descriptors that say where) and `placement`
(a slot taken and written, or the reason none is given)."""
