"""The tests' own port helper (tests/redis_process.py)."""

from __future__ import annotations

from tests.redis_process import free_port


def test_free_port_never_hands_out_a_port_twice() -> None:
    # The kernel's choice for a bind to port 0 repeats within a few hundred calls (27 repeats
    # in 1,000 here before the fix): a server given the same HTTP and gRPC port never got ready.
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
