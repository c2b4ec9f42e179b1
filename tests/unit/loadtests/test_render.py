"""loadtests.render: a report's blocks as Markdown and as one HTML page that say the same, the
page self-contained (images inlined) and escaped."""

from __future__ import annotations

from pathlib import Path

from loadtests.render import Block, Heading, Image, Paragraph, Table, to_html, to_markdown

BLOCKS: list[Block] = [
    Heading(1, "Load test of `demo`"),
    Paragraph("**PASS**: p99 <= 20 ms"),
    Table(["users", "answer"], [["1", "a|b"], ["2", "<script>"]]),
    Image("plot.png", "Throughput & latency"),
]


def test_markdown() -> None:
    assert to_markdown(BLOCKS).splitlines() == [
        "# Load test of `demo`", "",
        "**PASS**: p99 <= 20 ms", "",
        "| users | answer |", "|---|---|", "| 1 | a\\|b |", "| 2 | <script> |", "",
        "![Throughput & latency](plot.png)",
    ]  # fmt: skip


def test_html_inlines_the_images_and_escapes_the_text(tmp_path: Path) -> None:
    (tmp_path / "plot.png").write_bytes(b"\x89PNG-bytes")
    page = to_html(BLOCKS, tmp_path)
    assert "<title>Load test of demo</title>" in page  # the first heading, without backticks
    assert "<h1>Load test of <code>demo</code></h1>" in page
    assert "<p><strong>PASS</strong>: p99 &lt;= 20 ms</p>" in page
    assert "<tr><td>2</td><td>&lt;script&gt;</td></tr>" in page
    assert "<script>" not in page
    assert 'src="data:image/png;base64,iVBORy1ieXRlcw=="' in page
    assert '<img alt="Throughput &amp; latency"' in page


def test_a_page_without_a_heading_has_a_default_title(tmp_path: Path) -> None:
    assert "<title>Load test</title>" in to_html([Paragraph("nothing measured")], tmp_path)
