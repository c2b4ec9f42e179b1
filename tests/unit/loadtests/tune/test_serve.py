"""loadtests.tune.serve: `--serve-cmd` and `--workers` as `sluice tune` reads them: the command
split and checked, the workers it serves with, the range searched, and the command rewritten for
each count (starting and stopping the owned server: tests/integration/test_tune_e2e.py)."""

from __future__ import annotations

import sys

import pytest

from loadtests.tune.serve import (
    MAX_AUTO_WORKERS,
    auto_workers,
    parse_serve_cmd,
    parse_workers_range,
    served_workers,
    with_workers,
)


def test_the_serve_command_is_split_as_a_shell_would() -> None:
    argv = parse_serve_cmd(f"{sys.executable} -m server serve --model-repository 'my models'")
    assert argv == [sys.executable, "-m", "server", "serve", "--model-repository", "my models"]
    # Its refusals, as `sluice tune` names them: tune/test_cli.py.


def test_the_workers_a_command_serves_with() -> None:
    assert served_workers(["sluice", "serve"], cores=4) == 1
    assert served_workers(["sluice", "serve", "--workers", "3"], cores=4) == 3
    assert served_workers(["sluice", "serve", "--workers=2"], cores=4) == 2
    assert served_workers(["sluice", "serve", "--workers", "auto"], cores=4) == 4
    assert served_workers(["sluice", "serve", "--workers", "0"], cores=4) == 1
    with pytest.raises(ValueError, match=r"^has --workers 'many'; allowed: a number or auto$"):
        served_workers(["sluice", "serve", "--workers", "many"], cores=4)


def test_auto_is_one_worker_a_core_up_to_its_bound() -> None:
    assert [auto_workers(c) for c in (0, 1, 3, MAX_AUTO_WORKERS, 64)] == [1, 1, 3, 8, 8]


def test_a_workers_range_is_a_span_or_a_list() -> None:
    assert parse_workers_range("1:4") == (1, 2, 3, 4)
    assert parse_workers_range("4,1,2,2") == (1, 2, 4)
    for text, message in [
        ("a:b", r"^'a:b' is not START:STOP nor a list A,B,\.\.\.$"),
        ("0:2", r"^'0:2': need worker counts from 1 to 64"),
        ("1,65", r"^'1,65': need worker counts from 1 to 64"),
        ("3:2", r"^'3:2': need worker counts from 1 to 64"),  # an empty span
    ]:
        with pytest.raises(ValueError, match=message):
            parse_workers_range(text)


def test_each_count_replaces_the_commands_own_workers() -> None:
    argv = ["sluice", "serve", "--workers", "3", "--http-port", "9", "--workers=auto"]
    assert with_workers(argv, 2) == ["sluice", "serve", "--http-port", "9", "--workers", "2"]
    assert with_workers(["sluice", "serve"], 1) == ["sluice", "serve", "--workers", "1"]
