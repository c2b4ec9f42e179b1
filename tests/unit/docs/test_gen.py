"""The generated reference pages are current: regenerating them changes nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = (
    *(f"reference/{name}.md" for name in ("cli", "settings", "model-config", "metrics", "errors")),
    "benchmarks/results.md",
)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    # A subprocess: the loadtest subcommands import locust, which patches this process's sockets.
    done = subprocess.run(
        [sys.executable, "-m", "docs.gen", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("page", PAGES)
def test_the_committed_reference_page_is_what_the_code_generates(
    regenerated: Path, page: str
) -> None:
    committed = ROOT / "docs" / page
    assert committed.read_text() == (regenerated / page).read_text(), (
        f"docs/{page} is stale: run `python -m docs.gen` and commit the result"
    )


def test_the_pages_name_what_the_code_has(regenerated: Path) -> None:
    from server.settings import Settings

    settings = (regenerated / "reference" / "settings.md").read_text()
    assert all(f"| `{name}` |" in settings for name in Settings.model_fields)
    assert "| `cache.redis_url` |" in settings
    assert "`SLUICE_CACHE__REDIS_URL`" in settings
    model = (regenerated / "reference" / "model-config.md").read_text()
    assert "| `dynamic_batching.max_queue_delay_s` |" in model
    cli = (regenerated / "reference" / "cli.md").read_text()
    assert all(f"## `sluice {name}`" in cli for name in ("serve", "convert", "loadtest", "tune"))
    assert "`--http-port INTEGER`" in cli
    metrics = (regenerated / "reference" / "metrics.md").read_text()
    assert "| `sluice_requests_total` | counter | model, version, protocol, status |" in metrics
    assert "`sluice_generation_tokens_total`" in metrics
    assert "`sluice_gpu_memory_used_bytes`" in metrics
    errors = (regenerated / "reference" / "errors.md").read_text()
    assert "`QuotaExceeded` | 429 | `RESOURCE_EXHAUSTED` |" in errors
    assert "`DeadlineExceeded` | 504 | `DEADLINE_EXCEEDED` |" in errors
    results = (regenerated / "benchmarks" / "results.md").read_text()
    from docs.results import SECTIONS, current_run

    folder = ROOT / "loadtests" / "benchmarks" / "results"
    runs = [
        current_run(stem, (folder / f"{stem}.md").read_text()) for s in SECTIONS for stem in s.files
    ]
    assert len(runs) >= 5
    rows = [line for run in runs for line in run.splitlines() if line[:1] == "|"]
    assert all(f"\n{row}\n" in results for row in rows)
    assert "This checkout against another" not in results  # the history stays in the folder


def test_every_metric_the_guides_name_is_one_the_registry_has(regenerated: Path) -> None:
    families = set(
        re.findall(
            r"\| `(sluice_\w+?)(?:_total)?` \|",
            (regenerated / "reference" / "metrics.md").read_text(),
        )
    )
    not_metrics = {"sluice_config", "sluice_config_source"}  # model config parameters
    named = {
        (page.name, re.sub(r"_(total|bucket|sum|count)$", "", name))
        for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
        if page.parent.name != "reference" and page.name != "results.md"  # generated
        for name in re.findall(r"\bsluice_[a-z0-9_]+", page.read_text())
    }
    unknown = sorted((page, name) for page, name in named if name not in families | not_metrics)
    assert len(named) > 30
    assert not unknown, f"metrics named in the docs that the registry does not have: {unknown}"
