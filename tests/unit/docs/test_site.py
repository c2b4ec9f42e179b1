"""The docs site builds with `mkdocs build --strict`: a broken link, a missing page or an anchor
that is not there fails it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]


def _nav_pages(entries: list[object]) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages.extend(_nav_pages(value) if isinstance(value, list) else [str(value)])
    return pages


def test_mkdocs_build_strict_passes_and_every_page_is_in_the_nav(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    nav = set(_nav_pages(config["nav"]))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == nav, f"not in the nav: {pages - nav}; missing: {nav - pages}"
    for page in nav:
        built = tmp_path / "site" / page.removesuffix(".md").removesuffix("index") / "index.html"
        assert built.is_file(), page


def test_every_relative_link_in_the_readme_names_a_file_that_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    relative = [target for target in targets if not target.startswith(("http://", "https://"))]
    assert len(relative) >= 10  # it links into docs/
    assert not [target for target in relative if not (ROOT / target).exists()]


def test_the_readme_stays_short_with_the_two_quick_start_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is an entry point: move detail to docs/"
    quick_start = readme.split("## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = quick_start.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert commands == ["./dev.sh serve", "./dev.sh test"]
