"""Subcommands that need an optional extra, run where the extra is not installed: each says which
extra to install and exits 2, whatever arguments it was given (and `sluice serve --help` documents
every option). "Not installed" is made real for
the child process by blocking the extra's modules (a None entry in sys.modules makes importing
them fail and importlib.util.find_spec answer None, as for an absent package)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[3]
EXTRAS = {
    "loadtest": ("locust", "matplotlib", "httpx", "tritonclient"),
    "convert": ("torch", "onnxscript", "onnxslim", "skl2onnx", "sklearn"),
}


def sluice_without(blocked: tuple[str, ...], *args: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"sys.modules.update(dict.fromkeys({list(blocked)!r}))\n"
        "from server.cli import main\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("extra", "args"),
    [
        ("loadtest", ["loadtest", "--url", "http://127.0.0.1:8000", "--users", "2"]),
        ("loadtest", ["loadtest", "--help"]),
        ("convert", ["convert", "model.onnx", "--precision", "fp16"]),
        ("convert", ["convert"]),
    ],
)
def test_a_command_without_its_extra_names_it_and_exits_2(extra: str, args: list[str]) -> None:
    done = sluice_without(EXTRAS[extra], *args)
    assert done.returncode == 2, done.stderr
    assert f"pip install 'sluice[{extra}]'" in done.stderr
    assert f"'sluice {extra}' needs the {extra} extra" in done.stderr
    assert "No such option" not in done.stderr


def test_grpc_load_without_tritonclient_names_the_extra() -> None:
    done = sluice_without(("tritonclient",), "loadtest", "--protocol", "grpc", "--users", "1")
    assert done.returncode == 2, done.stderr
    assert "--protocol grpc needs tritonclient" in done.stderr
    assert "pip install 'sluice[loadtest]'" in done.stderr


def test_top_level_help_says_what_each_missing_command_needs() -> None:
    done = sluice_without((*EXTRAS["loadtest"], *EXTRAS["convert"]), "--help")
    assert done.returncode == 0, done.stderr
    lines = {
        line.split()[0]: line for line in done.stdout.splitlines()[1:] if line.startswith("  ")
    }
    for extra in EXTRAS:
        assert f"pip install 'sluice[{extra}]'" in lines[extra]
    assert "needs" not in lines["serve"]


def test_every_serve_option_has_help() -> None:
    from server.cli import serve

    undocumented = [
        param.opts[0]
        for param in serve.params
        if isinstance(param, click.Option) and not param.help
    ]
    assert undocumented == []
