"""docs.results: the benchmark results page, one section per benchmark, the history left off."""

from __future__ import annotations

from pathlib import Path

import pytest

from docs import results
from docs.results import Section, current_run, is_history, results_page, section_text

ROOT = Path(__file__).resolve().parents[3]
FOLDER = ROOT / "loadtests" / "benchmarks" / "results"


def test_every_committed_result_is_on_the_page_or_history() -> None:
    placed = [stem for section in results.SECTIONS for stem in section.files]
    assert len(placed) == len(set(placed)), "a results file placed twice"
    stems = {path.stem for path in FOLDER.glob("*.md")}
    assert set(placed) <= stems, f"sections name files that are not there: {set(placed) - stems}"
    assert {stem for stem in stems - set(placed) if not is_history(stem)} == set()
    assert (FOLDER / "history.md").is_file()


def test_history_is_the_versus_runs_and_its_index() -> None:
    assert is_history("versus")
    assert is_history("versus_respond")
    assert is_history("history")
    assert not is_history("batching")


def test_a_results_file_no_section_places_fails_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "batching.md").write_text("# Batching benchmark\n\n| a |\n|---|\n| 1 |\n")
    (tmp_path / "versus_x.md").write_text("# This checkout against another\n")
    (tmp_path / "new_bench.md").write_text("| b |\n")
    monkeypatch.setattr(results, "SECTIONS", (Section("Batching", "It batches.", ("batching",)),))
    with pytest.raises(
        ValueError, match=r"results with no section in docs/results\.py: new_bench$"
    ):
        results_page(tmp_path, "")
    (tmp_path / "new_bench.md").unlink()
    page = results_page(tmp_path, "<!-- header -->\n")
    assert page.startswith("<!-- header -->\n")
    assert "## Batching\n\nIt batches.\n" in page
    assert "\n| 1 |\n" in page
    assert "This checkout against another" not in page


def test_one_file_gives_the_section_its_body_and_several_their_own_headings(
    tmp_path: Path,
) -> None:
    (tmp_path / "one.md").write_text("# One benchmark\n\nCommand: x.\n\n## Detail\n\n| r |\n")
    (tmp_path / "two.md").write_text("| t |\n")
    single = section_text(Section("One", "Shows one.", ("one",)), tmp_path)
    assert single.splitlines()[:3] == ["## One", "", "Shows one."]
    assert "# One benchmark" not in single
    assert "\n### Detail\n" in single
    grouped = section_text(Section("Both", "Shows both.", ("one", "two")), tmp_path)
    assert "\n### One benchmark\n" in grouped
    assert "\n#### Detail\n" in grouped
    assert "\n### Two\n" in grouped  # a file without a title is named after itself


def test_the_tuning_page_keeps_its_first_runs_and_leaves_the_repeats() -> None:
    text = (FOLDER / "tune.md").read_text()
    assert "## Notes" in text
    run = current_run("tune", text)
    assert "## `sluice tune`: tuned vs default" in run
    assert "## `auto` vs fixed 2 ms on the CNN\n" in run
    assert "## `auto` vs fixed 2 ms on the CNN, again" not in run
    assert "## Notes" not in run
    assert current_run("batching", "# B\n\n## Notes\n") == "# B\n\n## Notes"
