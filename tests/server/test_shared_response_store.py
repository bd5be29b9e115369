"""The Responses store several API server processes share (``--api-server-count N``): what one
process stores, another finds (and deletes); the conversation comes back as it was stored; the
least recently used response goes first past the capacity, as in the in-memory store."""

from __future__ import annotations

from qserve.server.protocol import ChatMessage, FunctionCall, ToolCall
from qserve.server.responses import ResponseStore, StoredResponse
from qserve.server.shared_response_store import SharedResponseStore


def _stored(i: int) -> StoredResponse:
    conversation = [
        ChatMessage(role="user", content=f"question {i}"),
        ChatMessage(
            role="assistant",
            content=None,
            tool_calls=[ToolCall(id=f"call_{i}", function=FunctionCall(name="f", arguments='{"x": 1}'))],
        ),
        ChatMessage(role="tool", content="42", tool_call_id=f"call_{i}"),
    ]
    return StoredResponse({"id": f"resp_{i}", "object": "response", "output": [{"text": "é ✓"}]}, conversation)


def test_one_process_stores_another_finds_and_deletes(tmp_path):
    path = str(tmp_path / "responses.sqlite3")
    first, second = SharedResponseStore(path), SharedResponseStore(path)  # two processes' connections
    first.put("resp_1", _stored(1))
    found = second.get("resp_1")
    assert found == _stored(1)  # the response and every message field, as stored
    assert found.conversation[1].model_fields_set == _stored(1).conversation[1].model_fields_set
    assert second.get("resp_2") is None
    assert second.delete("resp_1") and not first.delete("resp_1")
    assert first.get("resp_1") is None and len(first) == 0


def test_the_least_recently_used_goes_first_as_in_memory(tmp_path):
    shared = SharedResponseStore(str(tmp_path / "responses.sqlite3"), capacity=3)
    memory = ResponseStore(capacity=3)
    for store in (shared, memory):
        for i in range(3):
            store.put(f"resp_{i}", _stored(i))
        assert store.get("resp_0") is not None  # used: now the most recent
        store.put("resp_3", _stored(3))
    for store in (shared, memory):
        assert len(store) == 3
        assert store.get("resp_1") is None  # the least recently used went
        assert all(store.get(f"resp_{i}") is not None for i in (0, 2, 3))


def test_api_servers_opening_a_new_store_at_once_all_succeed(tmp_path) -> None:
    """Every API server of ``--api-server-count N`` opens the store as it starts, at the same moment.
    Switching a new file to WAL takes an exclusive lock that SQLite's busy timeout does not wait for:
    one of them got "database is locked" at once and died, which stopped the run (the parent now
    opens the store first, and an open waits for the switch)."""
    import threading

    failures = []
    for attempt in range(12):
        path = str(tmp_path / f"responses-{attempt}.sqlite3")
        start = threading.Barrier(4)

        def open_store(path: str = path, start: threading.Barrier = start) -> None:
            start.wait()
            try:
                SharedResponseStore(path).close()
            except Exception as err:  # noqa: BLE001 - collected: the assertion below names it
                failures.append(repr(err))

        threads = [threading.Thread(target=open_store) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not failures, failures[:3]
