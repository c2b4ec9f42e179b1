"""Rendering a report's blocks as Markdown and as one self-contained HTML page.

The report is built once as a list of blocks, so report.md and report.html always say the same.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Heading:
    """`#` to `###`; the first one is the page title."""

    level: int
    text: str


@dataclass(frozen=True, slots=True)
class Paragraph:
    text: str
    """Plain text; `backticks` mark code and **stars** mark bold, as in Markdown."""


@dataclass(frozen=True, slots=True)
class Table:
    """Cells are inline text like a Paragraph's."""

    headers: Sequence[str]
    rows: Sequence[Sequence[str]]


@dataclass(frozen=True, slots=True)
class Image:
    """A PNG in the report folder: linked from Markdown, inlined in HTML."""

    filename: str
    title: str


Block = Heading | Paragraph | Table | Image


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(blocks: Sequence[Block]) -> str:
    """GitHub-flavoured Markdown; images are linked by file name."""
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append("#" * block.level + " " + block.text)
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Table):
            out.append("| " + " | ".join(_md_cell(h) for h in block.headers) + " |")
            out.append("|" + "---|" * len(block.headers))
            out.extend("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows)
        else:
            out.append(f"![{block.title}]({block.filename})")
        out.append("")
    return "\n".join(out)


def _inline(text: str) -> str:
    escaped = html.escape(text)
    escaped = re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", escaped)


def to_html(blocks: Sequence[Block], folder: Path) -> str:
    """One HTML file with every image inlined (it can be mailed or attached to a CI run)."""
    body: list[str] = []
    title = next((b.text for b in blocks if isinstance(b, Heading)), "Load test")
    for block in blocks:
        if isinstance(block, Heading):
            body.append(f"<h{block.level}>{_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            body.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline(h)}</th>" for h in block.headers)
            rows = "".join(
                "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>"
                for row in block.rows
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        else:
            data = base64.b64encode((folder / block.filename).read_bytes()).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(block.title)}" '
                f'src="data:image/png;base64,{data}"><figcaption>{html.escape(block.title)}'
                "</figcaption></figure>"
            )
    style = (
        "body{font-family:sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
        "table{border-collapse:collapse;margin:1rem 0}th,td{border:1px solid #ccc;"
        "padding:.25rem .6rem;text-align:right}th{background:#f3f3f3}"
        "td:first-child,th:first-child{text-align:left}img{max-width:100%}"
    )
    plain_title = html.escape(title.replace("`", ""))
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{plain_title}</title><style>{style}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
