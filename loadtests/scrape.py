"""Scraping the server's Prometheus `/metrics` and computing what changed during a step.

A snapshot is a flat map from (sample name, sorted labels) to value. Deltas sum every label set
that matches the model (metrics without a `model` label match any model); a metric the server
does not export is None, and the report says "not exported"; one it declares (`# TYPE`) with no
sample yet, as a labelled counter before its first increment, is exported and zero. A counter that
went down means the server restarted in between: its value after the restart is the delta.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests.results import Histogram, ServerMetrics

SampleKey = tuple[str, tuple[tuple[str, str], ...]]

BATCH_SIZE = "sluice_batch_size"
QUEUE_WAIT = "sluice_queue_wait_seconds"
REQUESTS = "sluice_requests_total"
CACHE_HITS = "sluice_cache_hits_total"
CACHE_MISSES = "sluice_cache_misses_total"
REJECTIONS = "sluice_admission_rejections_total"


@dataclass(slots=True)
class Snapshot:
    """One scrape; `error` says why there is nothing in it."""

    samples: dict[SampleKey, float] = field(default_factory=dict)
    error: str | None = None
    families: set[str] = field(default_factory=set)
    """Metric families the page declares, samples or not (counters without `_total`)."""

    @classmethod
    def from_text(cls, text: str) -> Snapshot:
        """Parse a Prometheus text exposition; ValueError if it is not one."""
        snapshot = cls()
        for family in text_string_to_metric_families(text):
            snapshot.families.add(family.name)
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                snapshot.samples[key] = float(sample.value)
        return snapshot

    def declares(self, name: str) -> bool:
        """Whether the family of sample `name` is on the page (a counter's `_total` dropped)."""
        return name.removesuffix("_total") in self.families


def parse(text: str) -> dict[SampleKey, float]:
    """Every sample of a Prometheus text exposition, keyed by name and labels."""
    return Snapshot.from_text(text).samples


def scrape(url: str, headers: Mapping[str, str], timeout_s: float = 5.0) -> Snapshot:
    """GET the metrics page; any failure is a Snapshot with `error` set, never an exception."""
    try:
        response = httpx.get(url, headers=dict(headers), timeout=timeout_s)
    except httpx.HTTPError as exc:
        return Snapshot(error=f"cannot read {url}: {exc!r}")
    if response.status_code != 200:
        return Snapshot(error=f"{url} answered {response.status_code}")
    try:
        return Snapshot.from_text(response.text)
    except ValueError as exc:
        return Snapshot(error=f"{url} is not Prometheus text: {exc}")


def _matches(labels: tuple[tuple[str, str], ...], model: str) -> bool:
    value = dict(labels).get("model")
    return value is None or value == model


def _select(
    snapshot: Snapshot, name: str, model: str, keep: tuple[str, ...] = ()
) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples called `name` for `model`, summed over every label not in `keep`."""
    selected: dict[tuple[tuple[str, str], ...], float] = {}
    for (sample, labels), value in snapshot.samples.items():
        if sample != name or not _matches(labels, model):
            continue
        key = tuple((k, v) for k, v in labels if k in keep)
        selected[key] = selected.get(key, 0.0) + value
    return selected


def _delta(after: float, before: float) -> float:
    return after - before if after >= before else after


def counter_delta(before: Snapshot, after: Snapshot, name: str, model: str) -> float | None:
    """How much the counter grew (all matching label sets summed), or None if not exported."""
    now = _select(after, name, model)
    if not now:
        return 0.0 if after.declares(name) else None
    return _delta(now[()], _select(before, name, model).get((), 0.0))


def counter_delta_by(
    before: Snapshot, after: Snapshot, name: str, model: str, *labels: str
) -> dict[str, float] | None:
    """Counter growth per value of `labels` (joined by `/`: requests by status, rejections by
    tenant/reason); None if not exported."""
    now = _select(after, name, model, keep=labels)
    if not now:
        return {} if after.declares(name) else None
    then = _select(before, name, model, keep=labels)
    grown = {
        "/".join(dict(key).get(label, "") for label in labels): _delta(v, then.get(key, 0.0))
        for key, v in now.items()
    }
    return {value: count for value, count in sorted(grown.items()) if count > 0}


def histogram_delta(before: Snapshot, after: Snapshot, name: str, model: str) -> Histogram | None:
    """The histogram's observations between the scrapes, or None if not exported."""
    now = _select(after, name + "_bucket", model, keep=("le",))
    if not now:
        return Histogram(bounds=[], counts=[0.0], sum=0.0) if after.declares(name) else None
    then = _select(before, name + "_bucket", model, keep=("le",))
    grown = {dict(key)["le"]: _delta(v, then.get(key, 0.0)) for key, v in now.items()}
    ordered = sorted(grown.items(), key=lambda item: float(item[0]))
    bounds = [float(le) for le, _ in ordered if float(le) != float("inf")]
    counts = [count for _, count in ordered]
    if len(counts) == len(bounds):  # no +Inf bucket exported: the last bound holds everything
        counts.append(counts[-1] if counts else 0.0)
    total = _select(after, name + "_sum", model).get((), 0.0)
    earlier = _select(before, name + "_sum", model).get((), 0.0)
    return Histogram(bounds=bounds, counts=counts, sum=_delta(total, earlier))


def server_metrics(before: Snapshot, after: Snapshot, model: str) -> ServerMetrics:
    """Everything the report shows from the server side, for one window."""
    error = before.error or after.error
    if error is not None:
        return ServerMetrics(error=error)
    return ServerMetrics(
        batch_size=histogram_delta(before, after, BATCH_SIZE, model),
        queue_wait_s=histogram_delta(before, after, QUEUE_WAIT, model),
        requests_by_status=counter_delta_by(before, after, REQUESTS, model, "status"),
        cache_hits=counter_delta(before, after, CACHE_HITS, model),
        cache_misses=counter_delta(before, after, CACHE_MISSES, model),
        rejections=counter_delta_by(before, after, REJECTIONS, model, "tenant", "reason"),
    )
