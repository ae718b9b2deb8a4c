"""tokenfab.server.wait_idle (the multi-node leader's preStop hook): it reads the gauges that the server's
own /metrics renders, waits while requests run or wait, and returns as soon as the server is idle or gone."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.server.fake_engine import FakeStats
from tokenfab.server.metrics import ServerMetrics
from tokenfab.server.wait_idle import main, requests_in_flight, wait_idle


class _Load:
    """What the fake server's engine reports; a test changes it while wait_idle polls."""

    def __init__(self) -> None:
        self.stats = FakeStats()
        self.waiting = 0
        self.scrapes = 0


@pytest.fixture()
def metrics_server():
    load = _Load()
    metrics = ServerMetrics("m", stats=lambda: load.stats, waiting=lambda: load.waiting)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            load.scrapes += 1
            body = metrics.render()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", load
    finally:
        server.shutdown()
        server.server_close()


def test_in_flight_is_read_from_the_servers_own_metrics():
    stats = FakeStats(num_running=3)
    text = ServerMetrics("m", stats=lambda: stats, waiting=lambda: 2).render().decode()
    assert requests_in_flight(text) == 5
    idle = FakeStats()
    assert requests_in_flight(ServerMetrics("m", stats=lambda: idle, waiting=lambda: 0).render().decode()) == 0


def test_waits_while_requests_run_then_returns_once_idle(metrics_server):
    url, load = metrics_server
    load.stats.num_running = 1
    load.waiting = 1
    timer = threading.Timer(0.3, lambda: (setattr(load.stats, "num_running", 0), setattr(load, "waiting", 0)))
    timer.start()
    try:
        assert wait_idle(url, timeout=30, interval=0.05)
    finally:
        timer.cancel()
    assert load.stats.num_running == 0 and load.scrapes >= 3  # it polled through the busy phase


def test_times_out_while_busy(metrics_server):
    url, load = metrics_server
    load.waiting = 4
    assert not wait_idle(url, timeout=0.3, interval=0.05)
    assert load.scrapes >= 2


def test_one_idle_poll_is_not_enough(metrics_server):
    """Idle must be seen twice in a row: a request that arrives between two polls is still waited for."""
    url, load = metrics_server
    assert wait_idle(url, timeout=5, interval=0.05)
    assert load.scrapes == 2


def test_a_server_that_is_gone_counts_as_idle():
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as probe:
        port = probe.server_address[1]  # a port nothing listens on once this block closes
    assert main(["--port", str(port), "--timeout", "5", "--interval", "0.05"]) == 0
