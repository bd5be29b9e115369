"""bench/health_probe.py: latencies of /health under load, failures counted by what failed."""

from __future__ import annotations

import http.server
import json
import threading

from bench import health_probe


def _serve(status: int) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_probes_report_percentiles_and_count_a_503_as_a_failure(tmp_path, capsys):
    ok = _serve(200)
    try:
        out = tmp_path / "health.json"
        argv = ["--port", str(ok.server_address[1]), "--interval", "0.02", "--duration", "0.3", "--out", str(out)]
        assert health_probe.main(argv) == 0
        result = json.loads(out.read_text())
        assert result["failures"] == 0 and result["probes"] >= 5
        assert 0 < result["p50_ms"] <= result["p99_ms"] <= result["max_ms"] < 5000
        slowest = result["slowest_at_s_ms"]
        assert len(slowest) == 5 and slowest[0][1] == result["max_ms"] and all(0 <= at < 1 for at, _ in slowest)
    finally:
        ok.shutdown()
    down = _serve(503)
    try:
        assert (
            health_probe.main(["--port", str(down.server_address[1]), "--interval", "0.02", "--duration", "0.1"]) == 0
        )
        printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1].split(": ", 1)[1])
        assert printed["probes"] == printed["failures"] >= 1 and printed["failure_examples"][0] == "HTTP 503"
    finally:
        down.shutdown()


def test_main_gives_back_the_callers_signal_handlers():
    import signal

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    health_probe.main(["--port", "9", "--interval", "0.01", "--duration", "0.05", "--timeout", "0.2"])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_the_slowest_probes_are_listed_with_when_they_were_sent():
    latencies = [5.0, 120.0, 6.0, 7.0, 90.0, 5.5, 6.5]
    sent_at = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    result = health_probe.summary(latencies, [], sent_at)
    assert result["slowest_at_s_ms"] == [[0.1, 120.0], [0.4, 90.0], [0.3, 7.0], [0.6, 6.5], [0.2, 6.0]]
    assert "slowest_at_s_ms" not in health_probe.summary(latencies, [])


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert health_probe.percentile(values, 99) == 99.0 and health_probe.percentile(values, 50) == 50.0
    assert health_probe.percentile([7.0], 99) == 7.0
