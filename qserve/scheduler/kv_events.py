"""KV-cache events: which full blocks enter and leave the prefix cache, as plain data.

Routers that place requests by prefix (llm-d's KV-cache-aware scorer) keep an index of which
replica holds which prefix; they learn it from these events (published by
``qserve.engine.kv_events`` in vLLM's wire format). Recording is off unless a
``KVEventRecorder`` is attached to the ``BlockPool`` (``pool.kv_events``).

Knows: the three events (``BlockStored``: consecutive blocks of one sequence with their
hashes, the parent hash and the real token ids; ``BlockRemoved``: evicted hashes;
``AllBlocksCleared``), the owner (model) each belongs to, and how to read a block's token ids
from a request. Must not know: torch, ZMQ, msgpack, the scheduler's queues. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from qserve.request import Request


@dataclass(frozen=True, slots=True)
class BlockStored:
    owner: str
    block_hashes: list[int]  # consecutive full blocks of one sequence, in order
    parent_block_hash: int | None  # the block before the first one (None: the sequence's first block)
    token_ids: list[int]  # every token of those blocks, len == len(block_hashes) * block_size
    block_size: int
    lora_id: int | None = None  # the LoRA adapter the blocks were computed with (None: the base model)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    owner: str
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    owner: str | None  # None: every owner of the pool


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    """Events in the order they happened, until ``take``n (one thread: the step thread)."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def record(self, event: KVEvent) -> None:
        self._events.append(event)

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


def block_token_ids(request: Request, first_block: int, num_blocks: int, block_size: int) -> list[int]:
    """Token ids of blocks ``[first_block, first_block + num_blocks)`` of the request's sequence."""
    start, end = first_block * block_size, (first_block + num_blocks) * block_size
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return list(prompt[start:end])
    outputs = request.output_token_ids
    if start >= num_prompt:
        return list(outputs[start - num_prompt : end - num_prompt])
    return list(prompt[start:]) + list(outputs[: end - num_prompt])
