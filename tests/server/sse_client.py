"""Streaming completions read in background threads, for shutdown tests."""

from __future__ import annotations

import json
import threading

import httpx

from tests.server.conftest import wait_for


class Stream(threading.Thread):
    """A streaming completion read in a thread: its data payloads, in order."""

    def __init__(self, url: str, max_tokens: int, model: str = "llama") -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = {"model": model, "prompt": "a b c", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=60) as reply:
                assert reply.status_code == 200
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err

    def finish_reason(self) -> str | None:
        assert self.error is None, self.error
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [json.loads(e) for e in self.events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        return chunks[-1]["choices"][0]["finish_reason"]


def start_streams(url: str, *max_tokens: int, model: str = "llama") -> list[Stream]:
    """Start one stream per ``max_tokens`` and wait until each has sent its first event."""
    streams = [Stream(url, n, model) for n in max_tokens]
    for s in streams:
        s.start()
    assert wait_for(lambda: all(s.events or s.error for s in streams), timeout=30)
    return streams
