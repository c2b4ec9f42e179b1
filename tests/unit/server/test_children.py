"""server/children.py: a forked child runs its target with only the descriptors it was given,
its exit status says how the target ended, and orders reach it through its pipe."""

from __future__ import annotations

import os

import pytest

from engine.settings import SettingsError
from server.children import Child, fork_child, reap


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_child_keeps_only_the_descriptors_it_was_given() -> None:
    kept_r, kept_w = os.pipe()
    other_r, other_w = os.pipe()
    try:
        # Exit status 0 only if the kept pipe is open in the child and the other one is closed.
        pid = fork_child(lambda: 0 if _is_open(kept_w) and not _is_open(other_w) else 3, {kept_w})
        assert reap(pid) == 0
    finally:
        for fd in (kept_r, kept_w, other_r, other_w):
            os.close(fd)


def _exit_7() -> int:
    raise SystemExit(7)


def _unusable() -> int:
    raise SettingsError("tls.cert_file: no such file")


def _crash() -> int:
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("target", "status"),
    [(lambda: 5, 5), (_exit_7, 7), (_unusable, 1), (_crash, 1)],
    ids=["returned", "SystemExit", "SettingsError", "crash"],
)
def test_the_exit_status_says_how_the_target_ended(target: object, status: int) -> None:
    pid = fork_child(target, set())  # type: ignore[arg-type]
    assert reap(pid) == status


def test_an_order_reaches_the_child_and_one_to_a_closed_pipe_is_dropped() -> None:
    read, write = os.pipe()
    child = Child(pid=0, orders=write)
    child.order()
    child.order(b"D")
    assert os.read(read, 8) == b"SD"
    os.close(write)
    child.order()  # the child exited and its pipe is closed: nothing to tell, no error
    os.close(read)
