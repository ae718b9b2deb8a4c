"""``python -m tokenfab.server.wait_idle``: wait until a local ``tokenfab serve`` has no request in flight.

A Kubernetes preStop hook for a multi-node (torchrun) group's leader pod. On a single node, SIGTERM makes
``tokenfab serve`` drain by itself (uvicorn stops accepting, the engine finishes what runs). Under torchrun it
cannot: the container's first process is torchrun, which sends SIGTERM to each local rank's whole process
group, so rank 0's engine core exits at once, and the TP workers in the other pods stop with theirs. So the
leader's preStop hook first sleeps while the pod leaves the endpoints (no new traffic is sent to it), then
polls ``/metrics`` until the requests running plus waiting are 0 twice in a row (or ``--timeout`` passes);
only then does SIGTERM arrive, with nothing left to lose. A server that does not answer is taken as already
gone (exit 0); a timeout exits 1, which Kubernetes records as a FailedPreStopHook event on the pod.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tokenfab.server.metrics import PREFIX

IN_FLIGHT = (f"{PREFIX}_num_requests_running", f"{PREFIX}_num_requests_waiting")


def requests_in_flight(metrics_text: str) -> float:
    """Requests running plus waiting, summed over every sample (all models) of the two gauges."""
    return sum(sample.value for family in text_string_to_metric_families(metrics_text)
               if family.name in IN_FLIGHT for sample in family.samples)


def wait_idle(url: str, timeout: float, interval: float = 1.0, sleep: float = 0.0) -> bool:
    """True once ``url`` (a /metrics endpoint) shows nothing in flight on two polls in a row, or stops
    answering; False if ``timeout`` seconds (counted after ``sleep``) pass first."""
    time.sleep(sleep)
    deadline = time.monotonic() + timeout
    idle_polls = 0
    while True:
        try:
            with urllib.request.urlopen(url, timeout=max(0.5, interval)) as response:
                busy = requests_in_flight(response.read().decode())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return True  # the server is gone (or never came up): nothing to wait for
        idle_polls = idle_polls + 1 if busy == 0 else 0
        if idle_polls >= 2:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tokenfab.server.wait_idle", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000, help="the server's port on 127.0.0.1 (default 8000)")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to wait before the first poll (default 0)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for idle after --sleep (default 30)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    idle = wait_idle(f"http://127.0.0.1:{args.port}/metrics", args.timeout, args.interval, args.sleep)
    if not idle:
        print(f"wait_idle: requests still in flight after {args.timeout:g} s", file=sys.stderr)
    return 0 if idle else 1


if __name__ == "__main__":
    sys.exit(main())
