"""Publish KV-cache events over ZMQ in vLLM's wire format, for prefix-aware routers (llm-d).

Knows: vLLM's ``--kv-events-config`` JSON (``enable_kv_cache_events``, ``publisher``,
``endpoint``, ``topic``), the wire format (a ZMQ PUB socket; each message has three frames:
the topic, an 8-byte big-endian sequence number, and a msgpack ``[ts, [event, ...]]`` batch
whose events are tagged arrays: ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``), one topic per model (default ``kv@{pod}:{port}@{model}``), and
that hashes go out as unsigned 64-bit integers. Must not know: HTTP, how events are recorded
(``qserve.scheduler.kv_events``).

Exposure: ``BlockStored`` carries the token ids of every cached prompt block, and a ZMQ PUB
socket has no authentication, so the default endpoint binds loopback only (a subscriber on
the same host or pod, e.g. a sidecar). Binding any other address takes an explicit
``endpoint`` and logs a warning that prompts' token ids are published there.

Threads: built on any thread, then used only by the host's step thread, closed after it stops.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qserve.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

# Loopback only: the events carry prompts' token ids and ZMQ has no authentication.
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_TOPIC = "kv@{pod}:{port}@{model}"
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    endpoint: str = DEFAULT_ENDPOINT
    topic: str = DEFAULT_TOPIC  # {pod}: $POD_IP or the host name; {port}: the server's port; {model}


def parse_kv_events_config(text: str) -> KVEventsConfig | None:
    """vLLM's ``--kv-events-config`` JSON; None when events are not enabled."""
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise ValueError(f"--kv-events-config: not JSON ({err})") from err
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config: expected a JSON object")
    known = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "replay_endpoint", "buffer_steps", "hwm"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}")
    if raw.get("replay_endpoint"):
        raise ValueError("--kv-events-config: replay_endpoint is not supported (events are published live only)")
    if not raw.get("enable_kv_cache_events", False) or raw.get("publisher", "zmq") == "null":
        return None
    if raw.get("publisher", "zmq") != "zmq":
        raise ValueError(f"--kv-events-config: publisher {raw['publisher']!r} is not supported; use 'zmq'")
    topic = str(raw.get("topic", DEFAULT_TOPIC))
    try:
        topic.format(pod="pod", port=0, model="model")
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"--kv-events-config: topic {topic!r} may only use {{pod}}, {{port}} and {{model}}") from err
    return KVEventsConfig(endpoint=str(raw.get("endpoint", DEFAULT_ENDPOINT)), topic=topic)


def is_local_endpoint(endpoint: str) -> bool:
    """True if only this host can connect: ``ipc://``/``inproc://``, or TCP on a loopback address."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.strip("[]").split(";")[-1]  # "tcp://eth0;192.168.1.1:5555" binds the part after ';'
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name: reachable from elsewhere
        return False


def encode_event(event: KVEvent, medium: str) -> list[Any]:
    """One event as vLLM's tagged msgpack array."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else event.parent_block_hash & _U64
        hashes = [h & _U64 for h in event.block_hashes]
        return ["BlockStored", hashes, parent, list(event.token_ids), event.block_size, event.lora_id, medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [h & _U64 for h in event.block_hashes], medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


class ZmqKVEventPublisher:
    """A ZMQ PUB socket bound at ``config.endpoint``; one message per model per ``publish``."""

    def __init__(self, config: KVEventsConfig, *, port: int, medium: str = "GPU") -> None:
        import zmq

        self.config = config
        self.medium = medium
        self._pod = os.environ.get("POD_IP") or socket.gethostname()
        self._port = port
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(config.endpoint)
        self._seq = 0
        if not is_local_endpoint(config.endpoint):
            logger.warning(
                "KV events are published on %s, reachable from other hosts without authentication: every "
                "subscriber reads the token ids of every prompt (BlockStored). Bind tcp://127.0.0.1 or an "
                "ipc:// endpoint unless the network is trusted",
                self.endpoint,
            )

    @property
    def endpoint(self) -> str:
        """The bound address (with the real port when the endpoint asked for any port)."""
        import zmq

        return self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def topic(self, model: str) -> str:
        return self.config.topic.format(pod=self._pod, port=self._port, model=model)

    def publish(self, events: Sequence[KVEvent], model_of_owner: Mapping[str, str]) -> None:
        """Send ``events`` (in order), one batch per model; ``AllBlocksCleared(None)`` goes to every model."""
        import msgpack

        by_model: dict[str, list[list[Any]]] = {}
        for event in events:
            if event.owner is None:
                models = list(model_of_owner.values())
            else:
                models = [model_of_owner.get(event.owner, event.owner)]
            encoded = encode_event(event, self.medium)
            for model in models:
                by_model.setdefault(model, []).append(encoded)
        now = time.time()
        for model, batch in by_model.items():
            payload = msgpack.packb([now, batch], use_bin_type=True)
            self._socket.send_multipart([self.topic(model).encode(), self._seq.to_bytes(8, "big"), payload])
            self._seq += 1

    def close(self) -> None:
        self._socket.close()
        self._context.term()
