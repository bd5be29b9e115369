"""The front end's delivery of the engine core's messages (``EngineCoreClient``, issue 27): one
step's outputs are turned into text ``output_chunk_size`` sequences at a time, and other work on
the event loop (``/health``, new requests) runs between the chunks; messages are handled in the
order they arrived, a step's chunks never interleaved with the next message. No core process: the
client's delivery half over a stand-in output processor."""

from __future__ import annotations

import asyncio
import collections

from qserve.engine.core.client import OUTPUT_CHUNK_SIZE, EngineCoreClient
from qserve.engine.core.messages import ModelFailed, ModelOutputs, Outputs, RequestDelta
from qserve.engine.core.output_processor import Processed


class RecordingProcessor:
    """Records the request ids it is handed, in order; delivers nothing."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def process(self, delta: RequestDelta) -> Processed:
        self.log.append(delta.request_id)
        return Processed(None, [])

    def forget(self, request_id: str) -> None:
        self.log.append(f"forget {request_id}")


def delivery_half(log: list[str], chunk: int) -> EngineCoreClient:
    """The client's loop-side state, as ``__init__`` and ``start`` leave it, without a core."""
    client = object.__new__(EngineCoreClient)
    client._processors = {"m": RecordingProcessor(log)}
    client._tracked = {}
    client._stats = client._lora_info = None
    client.listener = None
    client.num_steps = 0
    client._inbox = collections.deque()
    client._inbox_task = None
    client.output_chunk_size = chunk
    return client


def step(*request_ids: str) -> Outputs:
    return Outputs([ModelOutputs("m", [RequestDelta(r, [], False) for r in request_ids], [len(request_ids)])])


def test_a_steps_outputs_yield_to_the_loop_between_chunks_in_order() -> None:
    log: list[str] = []

    async def scenario() -> None:
        client = delivery_half(log, chunk=2)
        client._loop = asyncio.get_running_loop()

        async def probe() -> None:  # what /health would be: one short task on the same loop
            log.append("probe")

        client._call_in_loop(client._on_message, step("a", "b", "c", "d", "e"))
        client._call_in_loop(client._on_message, ModelFailed("m", ["z"], "boom"))
        client._call_in_loop(client._on_message, step("f"))
        await asyncio.sleep(0)  # the hand-over (call_soon_threadsafe) runs; the inbox task starts
        asyncio.get_running_loop().create_task(probe())
        while client._inbox or not client._inbox_task.done():
            await asyncio.sleep(0)

    asyncio.run(scenario())
    # the probe ran after the first chunk of the five outputs, long before the step was done; the
    # failure and the next step came after the whole first step, in the order they were sent
    assert log.index("probe") <= 3
    assert [entry for entry in log if entry != "probe"] == ["a", "b", "c", "d", "e", "forget z", "f"]


def test_the_default_chunk_is_vllms() -> None:
    """128, as vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE: a step of up to 128 sequences is one chunk."""
    assert OUTPUT_CHUNK_SIZE == 128
