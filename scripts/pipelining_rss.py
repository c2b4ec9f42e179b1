"""Issue 38's scenario, measured: a client pipelines demo infer requests on one keep-alive
connection and never reads an answer; the server's RSS (every process of it) is printed before,
while the connection is open, and after it is closed.

    python scripts/pipelining_rss.py [--workers N] [--seconds S] [--connections C]

Starts `sluice serve` (the demo model, HTTP only) on free ports. A measurement for a report,
not a test: tests assert on counts (tests/integration/test_pipelining.py)."""

from __future__ import annotations

import argparse
import socket
import time

import httpx
import psutil

from tests.servers import ServerProcess

BODY = (
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": ['
    + b", ".join([b"0.5"] * 16)
    + b"]}]}"
)
REQUEST = (
    b"POST /v2/models/demo/infer HTTP/1.1\r\nhost: sluice\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


def rss_mb(server: ServerProcess) -> float:
    assert server.process is not None
    root = psutil.Process(server.process.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


def answered(server: ServerProcess) -> int:
    stats = httpx.get(f"{server.url}/v2/models/demo/stats", timeout=10).json()
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def flood(port: int, seconds: float, connections: int) -> tuple[list[socket.socket], int]:
    """Open `connections` that pipeline requests without reading for `seconds`; the requests
    the kernel took from them in all."""
    socks = []
    for _ in range(connections):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        socks.append(sock)
    chunk = REQUEST * 256
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        moved = False
        for sock in socks:
            try:
                sent += sock.send(chunk)
                moved = True
            except BlockingIOError:
                pass
            except OSError:  # closed by the server
                pass
        if not moved:
            time.sleep(0.05)
    return socks, sent // len(REQUEST)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--connections", type=int, default=1)
    args = parser.parse_args()
    server = ServerProcess("--workers", args.workers, grpc=False).start()
    try:
        print(f"RSS before: {rss_mb(server):.1f} MB")
        socks, taken = flood(server.http_port, args.seconds, args.connections)
        time.sleep(1.0)
        print(
            f"RSS with {args.connections} connection(s) open: {rss_mb(server):.1f} MB "
            f"({taken} requests sent, {answered(server)} answered)"
        )
        for sock in socks:
            sock.close()
        time.sleep(3.0)
        print(f"RSS 3 s after closing: {rss_mb(server):.1f} MB")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
