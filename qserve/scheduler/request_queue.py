"""The waiting queue of one scheduler: FCFS order with O(1) append, pop-front and removal by id.

Knows: requests' ids and arrival indices. Must not know: pages, budgets, torch.

Why not a ``deque``: finishing or aborting a waiting request must not cost a scan of the
queue. One client can queue tens of thousands of sequences and then hang up; with
``deque.remove`` each abort was O(queue) and the step thread that serves every model stalled
for minutes. Here the queue is an insertion-ordered dict keyed by request id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from qserve.request import Request


class RequestQueue:
    """FCFS queue of requests. ``remove`` is O(1); ``push_front_by_arrival`` is O(k) for the k
    older requests ahead of it (only preempted requests are ever older than the newest running)."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, Request] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items.values())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def append(self, request: Request) -> None:
        self._items[request.request_id] = request

    def peek(self) -> Request:
        """The oldest request (IndexError when empty)."""
        try:
            return next(iter(self._items.values()))
        except StopIteration:
            raise IndexError("peek from an empty RequestQueue") from None

    def popleft(self) -> Request:
        try:
            return self._items.popitem(last=False)[1]
        except KeyError:
            raise IndexError("pop from an empty RequestQueue") from None

    def remove(self, request_id: str) -> Request | None:
        """Remove a request by id in O(1); None if it is not queued."""
        return self._items.pop(request_id, None)

    def push_front_by_arrival(self, request: Request) -> None:
        """Put ``request`` at the front, behind any queued request that arrived before it."""
        older: list[str] = []
        for queued in self._items.values():
            if queued.arrival_index >= request.arrival_index:
                break
            older.append(queued.request_id)
        self._items[request.request_id] = request
        self._items.move_to_end(request.request_id, last=False)
        for request_id in reversed(older):
            self._items.move_to_end(request_id, last=False)
