from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtests.scrape import (
    BATCH_SIZE,
    REQUESTS,
    Snapshot,
    counter_delta,
    counter_delta_by,
    histogram_delta,
    parse,
    scrape,
    server_metrics,
)

BEFORE = """\
# TYPE sluice_requests counter
sluice_requests_total{model="demo",version="1",protocol="http",status="200"} 10
sluice_requests_total{model="demo",version="1",protocol="grpc",status="200"} 5
sluice_requests_total{model="other",version="1",protocol="http",status="200"} 100
# TYPE sluice_batch_size histogram
sluice_batch_size_bucket{model="demo",version="1",le="1"} 4
sluice_batch_size_bucket{model="demo",version="1",le="2"} 6
sluice_batch_size_bucket{model="demo",version="1",le="+Inf"} 6
sluice_batch_size_count{model="demo",version="1"} 6
sluice_batch_size_sum{model="demo",version="1"} 8
# TYPE sluice_cache_hits counter
sluice_cache_hits_total 3
"""

AFTER = """\
# TYPE sluice_requests counter
sluice_requests_total{model="demo",version="1",protocol="http",status="200"} 40
sluice_requests_total{model="demo",version="1",protocol="grpc",status="200"} 15
sluice_requests_total{model="demo",version="1",protocol="http",status="429"} 7
sluice_requests_total{model="other",version="1",protocol="http",status="200"} 900
# TYPE sluice_batch_size histogram
sluice_batch_size_bucket{model="demo",version="1",le="1"} 14
sluice_batch_size_bucket{model="demo",version="1",le="2"} 26
sluice_batch_size_bucket{model="demo",version="1",le="+Inf"} 27
sluice_batch_size_count{model="demo",version="1"} 27
sluice_batch_size_sum{model="demo",version="1"} 60
sluice_batch_size_bucket{model="demo",version="2",le="1"} 1
sluice_batch_size_bucket{model="demo",version="2",le="2"} 1
sluice_batch_size_bucket{model="demo",version="2",le="+Inf"} 1
sluice_batch_size_count{model="demo",version="2"} 1
sluice_batch_size_sum{model="demo",version="2"} 1
# TYPE sluice_cache_hits counter
sluice_cache_hits_total 13
# TYPE sluice_cache_misses counter
sluice_cache_misses_total 30
# TYPE sluice_admission_rejections counter
sluice_admission_rejections_total{tenant="slow",reason="rate"} 7
"""


def _snap(text: str) -> Snapshot:
    return Snapshot(samples=parse(text))


def test_counter_delta_sums_the_models_label_sets() -> None:
    assert counter_delta(_snap(BEFORE), _snap(AFTER), REQUESTS, "demo") == (40 + 15 + 7) - (10 + 5)
    assert counter_delta(_snap(BEFORE), _snap(AFTER), REQUESTS, "other") == 800


def test_counter_delta_by_label() -> None:
    by_status = counter_delta_by(_snap(BEFORE), _snap(AFTER), REQUESTS, "demo", "status")
    assert by_status == {"200": 40.0, "429": 7.0}
    both = counter_delta_by(_snap(BEFORE), _snap(AFTER), REQUESTS, "demo", "protocol", "status")
    assert both == {"grpc/200": 10.0, "http/200": 30.0, "http/429": 7.0}


def test_histogram_delta_merges_versions_and_subtracts() -> None:
    histogram = histogram_delta(_snap(BEFORE), _snap(AFTER), BATCH_SIZE, "demo")
    assert histogram is not None
    assert histogram.bounds == [1.0, 2.0]
    assert histogram.counts == [(14 + 1) - 4, (26 + 1) - 6, (27 + 1) - 6]
    assert histogram.sum == (60 + 1) - 8


def test_a_counter_that_went_down_means_a_restart() -> None:
    restarted = _snap("sluice_cache_hits_total 2\n")
    assert counter_delta(_snap(BEFORE), restarted, "sluice_cache_hits_total", "demo") == 2


def test_absent_metrics_are_none() -> None:
    before, after = _snap(BEFORE), _snap(BEFORE)
    assert counter_delta(before, after, "sluice_cache_misses_total", "demo") is None
    assert histogram_delta(before, after, "sluice_queue_wait_seconds", "demo") is None
    metrics = server_metrics(before, after, "demo")
    assert metrics.queue_wait_s is None
    assert metrics.cache_misses is None
    assert metrics.cache_hit_ratio is None
    assert metrics.rejections is None
    assert metrics.requests_by_status == {}  # exported, nothing new


def test_server_metrics_over_a_window() -> None:
    metrics = server_metrics(_snap(BEFORE), _snap(AFTER), "demo")
    assert metrics.error is None
    assert metrics.cache_hits == 10
    assert metrics.cache_misses == 30
    assert metrics.cache_hit_ratio == 0.25
    assert metrics.rejections == {"slow/rate": 7.0}
    assert metrics.batch_size is not None
    assert metrics.batch_size.count == 22


def test_a_failed_scrape_makes_every_metric_unavailable() -> None:
    metrics = server_metrics(Snapshot(error="refused"), _snap(AFTER), "demo")
    assert metrics.error == "refused"
    assert metrics.batch_size is None


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/metrics":
            assert self.headers["Authorization"] == "Bearer k"
            body, status = AFTER.encode(), 200
        else:
            body, status = b"not found", 404
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def metrics_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_scrape_over_http(metrics_url: str) -> None:
    snapshot = scrape(metrics_url + "/metrics", {"Authorization": "Bearer k"})
    assert snapshot.error is None
    assert snapshot.samples[("sluice_cache_hits_total", ())] == 13


def test_scrape_failures_are_reported_not_raised(metrics_url: str) -> None:
    missing = scrape(metrics_url + "/nope", {})
    assert missing.error == f"{metrics_url}/nope answered 404"
    closed = scrape("http://127.0.0.1:9/metrics", {}, timeout_s=1.0)
    assert closed.error is not None
    assert closed.error.startswith("cannot read http://127.0.0.1:9")


# What sluice itself exports before any cache lookup or rejection: the cache counters at 0, and
# the rejections family declared with no label set yet.
QUIET_SLUICE = """\
# HELP sluice_cache_hits_total Result cache hits.
# TYPE sluice_cache_hits_total counter
sluice_cache_hits_total 0.0
# HELP sluice_cache_misses_total Result cache misses.
# TYPE sluice_cache_misses_total counter
sluice_cache_misses_total 0.0
# HELP sluice_admission_rejections_total Requests refused by admission control.
# TYPE sluice_admission_rejections_total counter
# HELP sluice_batch_size Rows per execution.
# TYPE sluice_batch_size histogram
"""


def test_counters_that_are_zero_or_have_no_label_set_yet_are_exported() -> None:
    quiet = Snapshot.from_text(QUIET_SLUICE)
    metrics = server_metrics(quiet, quiet, "demo")
    assert (metrics.cache_hits, metrics.cache_misses) == (0.0, 0.0)
    assert metrics.rejections == {}
    assert metrics.batch_size is not None
    assert metrics.batch_size.count == 0
    assert counter_delta(quiet, quiet, "sluice_cache_errors_total", "demo") is None
