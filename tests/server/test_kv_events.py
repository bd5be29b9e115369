"""KV-cache events for prefix-aware routing: a ZMQ subscriber decodes qserve's messages with
vLLM's own message types (msgspec structs as vLLM declares them) and sees BlockStored with
the real token ids and hash chain, then BlockRemoved when those blocks are evicted."""

from __future__ import annotations

import asyncio
import time

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
pytest.importorskip("msgpack")

from qserve.engine.async_engine import AsyncEngine, ModelSpec, RequestItem, build_engines  # noqa: E402
from qserve.engine.kv_events import (  # noqa: E402
    KVEventsConfig,
    ZmqKVEventPublisher,
    encode_event,
    parse_kv_events_config,
)
from qserve.sampling_params import SamplingParams  # noqa: E402
from qserve.scheduler.kv_events import AllBlocksCleared  # noqa: E402
from qserve.scheduler.prefix_cache import hash_block_tokens, owner_seed  # noqa: E402
from tests.server.conftest import host_config  # noqa: E402

U64 = (1 << 64) - 1


# vLLM's declarations (vllm/distributed/kv_events.py), to decode exactly as its subscribers do.
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksClearedV(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksClearedV]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def test_config_parsing():
    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000"}')
    assert config == KVEventsConfig(endpoint="tcp://*:6000")
    for bad, message in [("[]", "JSON object"), ('{"x": 1}', "unknown key"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=message):
            parse_kv_events_config(bad)
    cleared = msgspec.msgpack.encode(encode_event(AllBlocksCleared(None), "GPU"))
    assert isinstance(msgspec.msgpack.decode(cleared, type=AllBlocksClearedV | BlockRemoved), AllBlocksClearedV)


def test_subscriber_sees_stored_then_removed_blocks(checkpoints):
    # 8 pages of 16 tokens: a 121-token request later needs all of them, evicting the cached ones.
    engines = build_engines([ModelSpec("llama", checkpoints["llama"])], host_config(num_kv_blocks=8))
    publisher = ZmqKVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*"), port=8000, medium="CPU")
    host = AsyncEngine(engines, kv_events=publisher)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher before anything is sent
    first = list(range(10, 50))  # 40 tokens: 2 full blocks
    second = list(range(100, 220))  # 120 tokens

    async def run() -> None:
        host.start()
        try:
            for request_id, prompt in (("a", first), ("b", second)):
                stream = await host.submit("llama", [RequestItem(request_id, prompt, SamplingParams(max_tokens=1))])
                async for _ in stream:
                    pass
        finally:
            await asyncio.to_thread(host.shutdown)

    asyncio.run(run())
    messages = []
    while sub.poll(timeout=2000):
        messages.append(sub.recv_multipart())
    sub.close()
    context.term()

    assert messages, "no KV events received"
    topics = {m[0].decode() for m in messages}
    assert len(topics) == 1 and topics.pop().endswith(":8000@llama")
    seqs = [int.from_bytes(m[1], "big") for m in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events = [e for m in messages for e in DECODER.decode(m[2]).events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]

    seed = owner_seed("llama")
    h0 = hash_block_tokens(seed, first[:16])
    h1 = hash_block_tokens(h0, first[16:32])
    assert stored[0].block_hashes == [h0 & U64, h1 & U64]
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == first[:32] and stored[0].block_size == 16 and stored[0].medium == "CPU"
    # The second prompt's 7 full blocks come in later events, chained from their first block.
    second_hashes = [h for e in stored[1:] for h in e.block_hashes]
    assert second_hashes[0] == hash_block_tokens(seed, second[:16]) & U64
    assert [t for e in stored[1:] for t in e.token_ids] == second[:112]
    # Its allocation evicted the first request's cached blocks.
    assert {h0 & U64, h1 & U64} <= set(removed)
    assert events.index(stored[0]) < min(i for i, e in enumerate(events) if isinstance(e, BlockRemoved))


def test_default_endpoint_is_loopback_and_another_address_is_warned(caplog):
    """Issue 31: the events carry prompts' token ids and ZMQ has no key; binding every interface
    by default let any host read a keyed server's prompts."""
    from qserve.engine.kv_events import DEFAULT_ENDPOINT, is_local_endpoint

    assert is_local_endpoint(DEFAULT_ENDPOINT)
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').endpoint == DEFAULT_ENDPOINT
    for endpoint, local in [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://[::1]:5557", True),
        ("tcp://localhost:1", True),
        ("ipc:///tmp/kv", True),
        ("tcp://*:5557", False),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://10.1.2.3:5557", False),
        ("tcp://eth0:5557", False),
    ]:
        assert is_local_endpoint(endpoint) is local, endpoint
    with caplog.at_level("WARNING", logger="qserve.engine.kv_events"):
        quiet = ZmqKVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*"), port=8000, medium="CPU")
        quiet.close()
        assert not caplog.records
        loud = ZmqKVEventPublisher(KVEventsConfig(endpoint="tcp://*:*"), port=8000, medium="CPU")
        loud.close()
    assert any("token ids of every prompt" in r.getMessage() for r in caplog.records)
