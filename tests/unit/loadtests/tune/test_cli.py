"""`sluice tune` on the command line: it belongs to the loadtest extra and refuses cleanly
without it, and bad arguments are usage errors (exit 2) naming the option."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from loadtests.tune.cli import tune

ROOT = Path(__file__).resolve().parents[4]


def test_without_the_loadtest_extra_tune_names_it_and_exits_2() -> None:
    code = (
        "import sys\n"
        "sys.modules.update(dict.fromkeys(['locust', 'matplotlib', 'httpx']))\n"
        "from server.cli import main\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "tune", "--model", "demo", "--slo-p99-ms", "10"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "'sluice tune' needs the loadtest extra" in done.stderr
    assert "pip install 'sluice[loadtest]'" in done.stderr


def test_the_slo_is_required() -> None:
    result = CliRunner().invoke(tune, ["--model", "demo"])
    assert result.exit_code == 2
    assert "--slo-p99-ms" in result.output


def test_a_bad_ramp_names_the_option(tmp_path: Path) -> None:
    args = ["--model", "demo", "--slo-p99-ms", "10", "--ramp", "8:2:1", "--out", str(tmp_path)]
    result = CliRunner().invoke(tune, args)
    assert result.exit_code == 2
    assert "--ramp" in result.output
    assert "need 1 <= START <= STOP" in result.output


def test_an_unreachable_server_fails_with_3_and_says_so(tmp_path: Path) -> None:
    args = ["--url", "http://127.0.0.1:9", "--model", "demo", "--slo-p99-ms", "10",
            "--out", str(tmp_path)]  # fmt: skip
    result = CliRunner().invoke(tune, args)
    assert result.exit_code == 3
    assert "cannot reach the server at http://127.0.0.1:9" in result.output


@pytest.mark.parametrize(
    ("extra", "option", "message"),
    [
        (["--serve-cmd", "sluice serve 'unclosed"], "--serve-cmd", "cannot split"),
        (["--serve-cmd", "   "], "--serve-cmd", "is empty"),
        (["--serve-cmd", "no-such-sluice-binary serve"], "--serve-cmd",
         "'no-such-sluice-binary' is not an executable file nor found on PATH"),
        (["--serve-cmd", f"{sys.executable} --workers"], "--serve-cmd", "ends with --workers"),
        (["--serve-cmd", f"{sys.executable} --workers lots"], "--serve-cmd",
         "has --workers 'lots'; allowed: a number or auto"),
        (["--workers-range", "1:2"], "--workers-range", "needs --serve-cmd"),
        (["--serve-cmd", sys.executable, "--workers-range", "2:x"], "--workers-range",
         "'2:x' is not START:STOP nor a list A,B,..."),
        (["--serve-cmd", sys.executable, "--workers-range", "0:2"], "--workers-range",
         "need worker counts from 1 to 64"),
    ],
)  # fmt: skip
def test_a_bad_serve_cmd_or_workers_range_is_usage_error_2(
    tmp_path: Path, extra: list[str], option: str, message: str
) -> None:
    args = ["--model", "demo", "--slo-p99-ms", "10", "--out", str(tmp_path), *extra]
    result = CliRunner().invoke(tune, args)
    assert result.exit_code == 2, result.output
    assert option in result.output
    assert message in " ".join(result.output.split())  # click wraps long messages
    assert not (tmp_path / "server.log").exists()  # nothing was started
