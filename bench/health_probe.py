"""Poll a server's /health while a benchmark loads it, and report the latencies (issue 27's target:
``/health`` p99 ≤ 50 ms throughout a run). A new connection per probe, as a Kubernetes probe makes.

    python3 bench/health_probe.py --port 8123 --out "$OUT/health_poisson16.json" &   # until SIGTERM
    PROBE=$!; ...run the load...; kill -TERM $PROBE; wait $PROBE

Knows: HTTP. Must not know: qserve's internals (it measures what an orchestrator sees).
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import sys
import time


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank of the sorted values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


SLOWEST = 5  # the slowest probes listed with when they were sent: a tail at the load's start or throughout


def summary(latencies_ms: list[float], failures: list[str], sent_at: list[float] | None = None) -> dict:
    """Percentiles of the answered probes; ``sent_at`` (seconds since the first probe, one per latency)
    adds the ``SLOWEST`` probes as ``[seconds, ms]`` pairs, slowest first."""
    if not latencies_ms:
        return {"probes": len(failures), "failures": len(failures), "failure_examples": failures[:5]}
    slowest = {}
    if sent_at is not None:
        ranked = sorted(zip(sent_at, latencies_ms, strict=True), key=lambda pair: -pair[1])[:SLOWEST]
        slowest = {"slowest_at_s_ms": [[round(at, 2), round(ms, 2)] for at, ms in ranked]}
    return {
        **slowest,
        "probes": len(latencies_ms) + len(failures),
        "failures": len(failures),
        "failure_examples": failures[:5],
        "p50_ms": round(statistics.median(latencies_ms), 2),
        "p90_ms": round(percentile(latencies_ms, 90), 2),
        "p99_ms": round(percentile(latencies_ms, 99), 2),
        "max_ms": round(max(latencies_ms), 2),
    }


def probe(host: str, port: int, timeout: float) -> tuple[float, str | None]:
    """One GET /health on a new connection: (milliseconds, None) or (milliseconds, what failed)."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        failure = None if response.status == 200 else f"HTTP {response.status}"
    except OSError as err:
        failure = f"{type(err).__name__}: {err}"
    finally:
        conn.close()
    return (time.perf_counter() - start) * 1e3, failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between probes")
    parser.add_argument("--timeout", type=float, default=5.0, help="a probe slower than this is a failure")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds to run (0: until SIGTERM)")
    parser.add_argument("--out", default="", help="JSON summary here (also printed)")
    args = parser.parse_args(argv)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    latencies, sent_at, failures = [], [], []
    first = time.monotonic()
    deadline = time.monotonic() + args.duration if args.duration > 0 else None
    try:
        while not stopping and (deadline is None or time.monotonic() < deadline):
            at = time.monotonic() - first
            elapsed, failure = probe(args.host, args.port, args.timeout)
            if failure is None:
                latencies.append(elapsed)
                sent_at.append(at)
            else:
                failures.append(failure)
            time.sleep(max(0.0, args.interval - elapsed / 1e3))
    finally:  # a caller's handlers back (the tests call main in pytest's process)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    result = summary(latencies, failures, sent_at)
    text = json.dumps(result)
    print(f"/health under load: {text}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
