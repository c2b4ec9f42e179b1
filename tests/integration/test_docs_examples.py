"""Every shell and Python example in README.md and docs/ runs as written, or says why it cannot.

A fenced `bash`, `console` or `python` block is preceded by one marker line:

    <!-- test: run -->               this test runs it against a real `sluice serve`
    <!-- test: skip (the reason) --> it cannot run here (GPU, Kubernetes, ...) and says why

Blocks run in a fresh folder with the venv's `sluice` and `python` first on PATH, against a
demo server this test starts on free ports (`localhost:8000` / `:8001` in the text become its
ports). A `sluice serve ... &` line starts the block's own server instead, with those flags on
free ports, in the block's shell (what the block wrote or exported before reaches it); the rest
of the block runs against it. What a page shows is checked: a console block's output lines (those
without `...`), and the `# comment` after a Python `print(...)`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.redis_process import free_port
from tests.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"bash", "sh", "shell", "console", "python", "py", "pycon"}
MARKER = re.compile(r"^<!-- test: (run|skip \((.+)\)) -->$")
SERVE = re.compile(r"^(?:\$ )?sluice serve(.*?)\s*&\s*$")


@dataclass
class Block:
    page: str
    line: int
    language: str
    text: str
    marker: str | None  # "run", "skip", or None when unmarked
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> Iterator[Block]:
    for path in PAGES:
        lines = path.read_text().splitlines()
        index = 0
        while index < len(lines):
            opening = re.match(r"^```(\w*)\s*$", lines[index])
            if opening is None:
                index += 1
                continue
            end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
            language = opening.group(1)
            first = lines[index + 1] if index + 1 < end else ""
            if not language and first.startswith(("$ ", "curl ", "python ", "pip ")):
                language = "console (unlabelled)"  # a shell session without its language
            if language in LANGUAGES or language.endswith("(unlabelled)"):
                before = lines[index - 1] if index else ""
                marker = MARKER.match(before)
                yield Block(
                    page=str(path.relative_to(ROOT)),
                    line=index + 1,
                    language=language,
                    text="\n".join(lines[index + 1 : end]) + "\n",
                    marker=None if marker is None else marker.group(1).split(" ", 1)[0],
                    reason="" if marker is None or marker.group(2) is None else marker.group(2),
                )
            index = end + 1


ALL = list(blocks())
RUN = [block for block in ALL if block.marker == "run"]


def test_every_shell_and_python_block_is_run_or_says_why_not() -> None:
    unlabelled = [block.id for block in ALL if block.language.endswith("(unlabelled)")]
    assert not unlabelled, f"give these shell blocks their language (console or bash): {unlabelled}"
    unmarked = [block.id for block in ALL if block.marker is None]
    assert not unmarked, (
        f"mark these blocks <!-- test: run --> or <!-- test: skip (why) -->: {unmarked}"
    )
    assert all(len(block.reason) >= 10 for block in ALL if block.marker == "skip")
    assert len(RUN) >= 10  # the examples a newcomer tries first are among them


def commands_and_output(block: Block) -> tuple[str, list[str]]:
    """The script to run and the output lines the page shows (console blocks only)."""
    if block.language != "console":
        return block.text, []
    script, shown, continued = [], [], False
    for line in block.text.splitlines():
        if line.startswith("$ ") or continued:
            script.append(line.removeprefix("$ "))
            continued = line.endswith("\\")
            if not continued:  # a terminal shows the next prompt on a new line: so do we
                script.append("echo")
        elif line.strip() and "..." not in line:
            shown.append(line.strip())
    return "\n".join(script) + "\n", shown


def expected_prints(source: str) -> list[str]:
    """`print(...)  # text`: the text each such line shows."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+# (.+)$", source, re.M)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(log_path=tmp_path_factory.mktemp("docs") / "server.log").start()
    yield server
    server.stop()


@pytest.mark.parametrize("block", RUN, ids=[block.id for block in RUN])
def test_the_example_runs_as_written(block: Block, demo: ServerProcess, tmp_path: Path) -> None:
    script, shown = commands_and_output(block)
    http_port, grpc_port = demo.http_port, demo.grpc_port
    serve = next((m for m in map(SERVE.match, script.splitlines()) if m), None)
    if serve is not None:
        # The block's own server, started in the block's shell (its files and exports reach
        # it) on free ports, polled until ready, stopped when the block ends.
        http_port, grpc_port = free_port(), free_port()
        start = (
            f"sluice serve{serve.group(1)} --http-port {http_port} --grpc-port {grpc_port} "
            "> server.log 2>&1 &\n"
            "SERVER=$!; trap 'kill $SERVER; wait $SERVER || true' EXIT\n"
            "for _ in $(seq 600); do\n"
            f"  curl -sf -o /dev/null 127.0.0.1:{http_port}/v2/health/ready && break\n"
            "  kill -0 $SERVER || { cat server.log; exit 1; }; sleep 0.1\n"
            "done\n"
        )
        script = script.replace(serve.group(0), start, 1)
    for local in ("localhost", "127.0.0.1"):
        script = script.replace(f"{local}:8000", f"127.0.0.1:{http_port}")
        script = script.replace(f"{local}:8001", f"127.0.0.1:{grpc_port}")
    if block.language in ("python", "py"):
        done = _run([sys.executable, "-c", script], tmp_path)
        shown = expected_prints(block.text)
    else:
        done = _run(["bash", "-euo", "pipefail", "-c", script], tmp_path)
    output = [line.strip() for line in (done.stdout + done.stderr).splitlines()]
    missing = [line for line in shown if line not in output]
    assert not missing, f"{block.id} shows lines it did not print: {missing}\n{done.stdout}"


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONWARNINGS"] = "ignore"  # a library's deprecation notice is not the example's output
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done
