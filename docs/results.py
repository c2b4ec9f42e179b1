"""The benchmark results page (docs/benchmarks/results.md) from the tables the benchmarks wrote in
loadtests/benchmarks/results/*.md: one section per benchmark, each with what its current run
shows (written here: check the sentence when a rerun changes the figures it names) and then the
run itself.

The record of the development (each `versus` run of one commit against the one before, and the
repeated runs and notes of the tuning benchmark) stays in the results folder, indexed by its
history.md, and is not on the page. A results file that no section places and that is not
history fails the page, so a new benchmark's results cannot be silently left off."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Section:
    """One benchmark on the page: its title, what its current run shows, and its results files
    (by stem, in order; a benchmark run in several layouts has a file for each)."""

    title: str
    shows: str
    files: tuple[str, ...]


SECTIONS = (
    Section(
        "Batching",
        "Dynamic batching against a plain FastAPI + onnxruntime server and raw ONNX Runtime, the "
        "limit. On the compute-bound CNN, binary HTTP reaches about 90% of the limit and 2.5x "
        "plain FastAPI at 16-64 connections (JSON about 1.7x: decoding 12,288 numbers a request "
        "costs). On the overhead-bound MLP the limit is out of reach for any HTTP server (the "
        "no-op floor itself is 6% of it); sluice serves 1.6-1.9x plain FastAPI at 16-64 "
        "connections (0.9x one request at a time).",
        ("batching",),
    ),
    Section(
        "Sizing: instances, threads and replicas",
        "The CNN on the host's two cores: one instance on one thread uses half the machine; two "
        "threads, two instances or two replicas behind nginx each reach 80-84% of two cores' "
        "limit, the replicas with the worst p99.",
        ("sizing",),
    ),
    Section(
        "Result cache",
        "Repeated CNN requests answered from the cache: over binary HTTP a memory hit is 14x the "
        "computed path and a Redis hit 8.6x; over JSON, decoding the input dominates both paths "
        "and a hit gains 2.6-3x.",
        ("cache",),
    ),
    Section(
        "JSON cost",
        "What JSON tensors cost per core against plain FastAPI: the MLP's small body at 2.0x the "
        "requests per CPU second, the CNN's 91 kB body at 1.49x (the target: 1.5x), where ONNX "
        "Runtime's compute is most of the request. Decoding the CNN's body from bytes to array "
        "takes 141 µs the server's way against 341 with orjson.",
        ("json_cost",),
    ),
    Section(
        "gRPC per-call cost",
        "ModelInfer on the MLP against grpc.aio's own no-op servicer: sluice answers 74% of the "
        "floor's calls per second (the target: 70%), at 216 µs of server CPU a call against "
        "the floor's 164.",
        ("grpc_floor",),
    ),
    Section(
        "Client shared memory",
        "Triton's system shared memory against binary HTTP and gRPC: on a large input it carries "
        "1.84x binary HTTP's requests per second at about half the server's CPU a request; on "
        "the CNN, where compute dominates, 80-83% of the limit against binary HTTP's 75-76%.",
        ("shared_memory",),
    ),
    Section(
        "Worker processes",
        "`--workers 2` against one process, in four core layouts. With the server on one core, "
        "the second process costs CPU (1.2-1.7x a request) and does not pay back; with two "
        "cores, two workers match or pass one process at 64 connections (1.00-1.08x req/s) "
        "while each request still costs more CPU. See the worker hop and wake-up benchmarks "
        "for where that CPU goes.",
        ("workers", "workers_both_cores", "workers_engine_alone", "workers_engine_core"),
    ),
    Section(
        "Worker hop",
        "The CPU a request pays to cross from a worker to the engine process, in one process "
        "without HTTP: about 17-22 µs a request at 16-64 in flight (the requests of a flush share "
        "a frame), 73 µs one at a time.",
        ("hop",),
    ),
    Section(
        "Wake-ups",
        "The floor under every crossing between processes on this host, a virtual machine: a "
        "round trip between two processes on one core costs each side about 2.5 µs of CPU, "
        "across two cores 28-33 µs.",
        ("wake",),
    ),
    Section(
        "Many models in one budget",
        "200 models and 4 pipelines served on demand in a quarter of the memory they need "
        "loaded, under a Zipf load: peak memory within the budget, no errors, warm p99 within "
        "the all-loaded server's, and a hit ratio above LRU by count and within 0.001 of the "
        "offline LRU by bytes (the one target missed).",
        ("many_models",),
    ),
    Section(
        "Text pipeline (in process)",
        "A tokenizer -> embedding -> normalization pipeline driven in process: each step's "
        "batcher groups the concurrent texts (20 rows a tokenizer batch at 64 in flight); the "
        "pipeline's own cost per text holds it at about 11% of the steps run directly at batch 64.",
        ("pipeline",),
    ),
    Section(
        "Converted text pipeline against sentence-transformers",
        "A MiniLM-shaped model converted by `sluice convert` and served over HTTP, against "
        "sentence-transformers' `encode` at its best batch size: fp32 at 1.06-1.08x on a quiet "
        "host (target 0.9x; 0.76x in a round on a host loaded past four times its cores) and "
        "int8 at 2.2-2.5x (target 1.3x), every run passing the conversion's accuracy gates.",
        ("text_pipeline",),
    ),
    Section(
        "Generation scheduler",
        "Continuous batching of 16 streams on one core against transformers: 8.5x the tokens/s "
        "of one stream at a time and above a static batch of 16 when every stream is as long; "
        "with streams of varied length, 2x the static batch, which waits for its longest.",
        ("generation", "generation_varied"),
    ),
    Section(
        "Generation over the OpenAI API",
        "A 100M-parameter decoder streamed over the OpenAI API: sluice's onnxruntime-genai "
        "backend (int4 fastest) and its own loop against transformers' continuous batching, "
        "ahead of it in tokens/s and server CPU a token at both prompt lengths (the genai "
        "backend's first token later at the short prompt).",
        ("generation_openai",),
    ),
    Section(
        "Tuning",
        "`sluice tune` against the default config: on the CNN with two server cores it found "
        "a config at 1.54x the default's req/s at the p99 SLO, confirmed in five alternated "
        "rounds; elsewhere it kept the default. `max_queue_delay_s: auto` against a fixed 2 ms "
        "delay: equal within this host's noise (three runs gave 0.94x, 1.05x and 0.97x per "
        "round). Only the first of those runs is here; the others and the notes are in the "
        "results folder's tune.md.",
        ("tune",),
    ),
)

HISTORY_INDEX = "history"
"""The results folder's index of the development record (not on the page)."""


def is_history(stem: str) -> bool:
    """A results file that records the development, not a benchmark's current run."""
    return stem == HISTORY_INDEX or stem.startswith("versus")


def current_run(stem: str, text: str) -> str:
    """A results file's current run: the tuning benchmark's file also holds the repeated
    `auto` runs and the notes of its development, which stay in the file."""
    if stem == "tune":
        later = r"^## (?:`auto` vs fixed 2 ms on the CNN, again|Notes)"
        text = re.split(later, text, flags=re.M)[0]
    return text.strip()


def section_text(section: Section, results: Path) -> str:
    """The section: its title, what it shows, and each file's run under it (a file's own title
    becomes a subheading where the section has several files, and is dropped where it has one)."""
    parts = [f"## {section.title}\n", section.shows + "\n"]
    for stem in section.files:
        text = current_run(stem, (results / f"{stem}.md").read_text())
        title, _, body = text.partition("\n") if text.startswith("# ") else ("", "", text)
        if len(section.files) > 1:
            heading = title.removeprefix("# ") or stem.replace("_", " ").capitalize()
            parts.append(f"### {heading}\n")
        # The file's own subheadings go under the section's level.
        depth = "##" if len(section.files) > 1 else "#"
        parts.append(re.sub(r"^(#+) ", rf"{depth}\1 ", body.strip(), flags=re.M) + "\n")
    return "\n".join(parts)


def results_page(results: Path, header: str) -> str:
    """The whole page; ValueError naming any results file no section places."""
    placed = {stem for section in SECTIONS for stem in section.files}
    stems = {path.stem for path in results.glob("*.md")}
    unplaced = sorted(stem for stem in stems - placed if not is_history(stem))
    if unplaced:
        raise ValueError(f"results with no section in docs/results.py: {', '.join(unplaced)}")
    lines = [
        header,
        "# Benchmark results\n",
        "The current run of each benchmark and what it shows, from the tables the benchmarks "
        "wrote in `loadtests/benchmarks/results/` (beside each table, a `.json` file holds "
        "every figure). How they were measured, and what they can and cannot say, is on the "
        "[benchmarks page](index.md). The figures come from a shared 2-core virtual machine: "
        "read ratios taken in the same run, not absolute rates.\n",
    ]
    lines += [section_text(section, results) for section in SECTIONS]
    lines.append(
        "## History\n\n"
        "Runs of one commit against the one before it (`python -m loadtests.benchmarks.versus`, "
        "which measures what a change did) and the repeated runs of the tuning benchmark are "
        "the record of the development, not results to read here: "
        "`loadtests/benchmarks/results/history.md` lists them.\n"
    )
    return "\n".join(lines)
