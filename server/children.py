"""The supervisor's child processes (server/supervisor.py): forking one with only the file
descriptors it needs, telling it what to do through its order pipe, and reaping it.

A child starts from a copy of the supervisor: its signal handlers and wake-up fd are reset to the
defaults, every descriptor it was not given is closed (another child's pipes, the wake-up pipe:
a pipe whose write end a wrong process holds open never reads EOF), and what `target` returns or
raises becomes its exit status, without the supervisor's cleanup running in it (`os._exit`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from engine.settings import SettingsError


@dataclass
class Child:
    """A forked child and the write end of its order pipe."""

    pid: int
    orders: int

    def order(self, order: bytes = b"S") -> None:
        """S: stop (drained). D, to the engine: start draining now, while the workers finish."""
        with contextlib.suppress(OSError):
            os.write(self.orders, order)


def fork_child(target: Callable[[], int], keep: set[int]) -> int:
    """Fork a child that runs `target` and exits with its status; fds it does not need closed."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for fd in _open_fds() - keep - {0, 1, 2}:  # another child's pipes, the wake-up pipe
            with contextlib.suppress(OSError):
                os.close(fd)
        code = target()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except SettingsError as exc:  # a setting the child found unusable: said as the CLI says it
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


def reap(pid: int) -> int:
    """Wait for the child `pid` to exit: its exit status (-N if signal N ended it)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}
