"""Arrivals: one load point is a request rate (Poisson, or all at once) and a concurrency cap.

Knows: how to send a list of requests with gamma-distributed inter-arrival gaps of mean
1 / rate (vLLM's ``--request-rate`` and ``--burstiness``: shape 1 is a Poisson process, below 1
burstier, above 1 more regular; ``inf`` sends them all at once) while at most ``max_concurrency`` are in
flight (vLLM's ``--max-concurrency``), seeded so a load point is repeatable, with a progress bar.
Must not know: request bodies beyond handing them to ``client.send_request``, summaries.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from qserve.bench.client import RequestResult, send_request
from qserve.bench.dataset import SampleRequest


@dataclass(frozen=True, slots=True)
class LoadPoint:
    request_rate: float  # requests/s; inf = all at once
    max_concurrency: int | None  # None = no cap
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps (1: Poisson)

    @property
    def label(self) -> str:
        parts = []
        if not math.isinf(self.request_rate):
            parts.append(f"rate {self.request_rate:g}/s")
        if self.max_concurrency is not None:
            parts.append(f"concurrency {self.max_concurrency}")
        return ", ".join(parts) or "all at once"


def arrival_offsets(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start at which each request is sent: 0 for ``inf``, else gaps drawn from
    a gamma distribution with shape ``burstiness`` and mean ``1 / rate`` (1.0: a Poisson process)."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        if burstiness == 1.0:
            t += rng.expovariate(rate)  # the same draws as before --burstiness existed
        else:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


async def run_load(
    client: httpx.AsyncClient,
    url: str,
    requests: list[SampleRequest],
    make_body: Callable[[SampleRequest], dict],
    point: LoadPoint,
    *,
    seed: int,
    headers: dict[str, str] | None = None,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send every request at ``point``'s load; return the results (in request order) and the
    wall time from the first send to the last response."""
    from tqdm.asyncio import tqdm

    offsets = arrival_offsets(len(requests), point.request_rate, seed, point.burstiness)
    seats = asyncio.Semaphore(point.max_concurrency) if point.max_concurrency else None
    bar = tqdm(total=len(requests), desc=point.label, unit="req", disable=not progress, leave=False)

    async def one(request: SampleRequest) -> RequestResult:
        if seats is None:
            result = await send_request(client, url, make_body(request), request.prompt_len, headers)
        else:
            async with seats:
                result = await send_request(client, url, make_body(request), request.prompt_len, headers)
        bar.update(1)
        return result

    tasks = []
    start = time.perf_counter()
    try:
        for request, offset in zip(requests, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = list(await asyncio.gather(*tasks))
    finally:
        bar.close()
    return results, time.perf_counter() - start
