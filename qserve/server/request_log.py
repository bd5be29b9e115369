"""The server's log lines about its work: one line per finished request, and a periodic
stats line while the server is busy (vLLM prints both; ``--disable-log-requests`` and
``--disable-log-stats`` turn them off).

Knows: what the lines say (request id from ``X-Request-Id``, model, prompt and output
tokens, time to first token, total time, finish reason; running / waiting sequences, KV
use and token rates per model) and how they are fed (it is a ``RequestListener``; the stats
line reads ``AsyncEngine.stats``). Must not know: HTTP routing, Prometheus, engines' internals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from qserve.engine.async_engine import AsyncEngine
from qserve.outputs import RequestOutput
from qserve.server.request_context import REQUEST_ID

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 10.0


class RequestLog:
    """A ``RequestListener`` that logs finished requests and counts tokens for the stats line."""

    def __init__(self, *, log_requests: bool = True) -> None:
        self.log_requests = log_requests
        self.prompt_tokens: dict[str, int] = {}
        self.generation_tokens: dict[str, int] = {}

    # RequestListener (loop thread; runs in the submitting request's context) -------------
    def on_first_token(self, model: str, seconds: float, num_prompt_tokens: int) -> None:
        self.prompt_tokens[model] = self.prompt_tokens.get(model, 0) + num_prompt_tokens

    def on_tokens(self, model: str, num_tokens: int, seconds_since_last: float | None) -> None:
        self.generation_tokens[model] = self.generation_tokens.get(model, 0) + num_tokens

    def on_finished(self, model: str, output: RequestOutput, seconds: float) -> None:
        if not self.log_requests:
            return
        ttft = output.metrics.get("first_token_latency")
        reasons = sorted({c.finish_reason or "abort" for c in output.outputs}) or ["abort"]
        lora = "" if output.lora_request is None else f" lora={output.lora_request.lora_name}"
        logger.info(
            "request %s (%s): model=%s%s prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs finish_reason=%s",
            REQUEST_ID.get() or "-",
            output.request_id,
            model,
            lora,
            len(output.prompt_token_ids),
            sum(len(c.token_ids) for c in output.outputs),
            "-" if ttft is None else f"{ttft:.3f}s",
            seconds,
            ",".join(reasons),
        )


class StatsLogger:
    """Every ``interval_s``, while any model has work or produced tokens since the last line,
    logs per model: running and waiting sequences, KV pages held, prompt and generation tok/s."""

    def __init__(
        self, host: Callable[[], AsyncEngine | None], counts: RequestLog, interval_s: float = STATS_INTERVAL_S
    ) -> None:
        self._host = host
        self._counts = counts
        self.interval_s = interval_s
        self._last: dict[str, tuple[int, int]] = {}
        self._last_time = time.monotonic()

    def log_once(self) -> int:
        """Log the lines due now; return how many were logged."""
        host = self._host()
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        self._last_time = now
        if host is None:
            return 0
        logged = 0
        for name, stats in host.stats().items():
            prompt = self._counts.prompt_tokens.get(name, 0)
            generation = self._counts.generation_tokens.get(name, 0)
            last_prompt, last_generation = self._last.get(name, (0, 0))
            self._last[name] = (prompt, generation)
            busy = stats["num_running"] or stats["num_waiting"]
            if not busy and prompt == last_prompt and generation == last_generation:
                continue
            logger.info(
                "stats %s: running=%d waiting=%d kv_cache=%.1f%% prompt=%.1f tok/s generation=%.1f tok/s",
                name,
                stats["num_running"],
                stats["num_waiting"],
                100.0 * stats["pool_pages_used"] / max(stats["pool_pages_total"], 1),
                (prompt - last_prompt) / elapsed,
                (generation - last_generation) / elapsed,
            )
            logged += 1
        return logged

    async def run(self) -> None:
        """Log forever (cancel the task to stop)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.log_once()
            except Exception:  # noqa: BLE001 - a stats line must never take the server down
                logger.exception("stats line failed")
