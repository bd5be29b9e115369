"""The Responses API's store shared by several API server processes (``--api-server-count N``):
a response stored by one process is found by ``previous_response_id`` and ``GET`` / ``DELETE
/v1/responses/{id}`` on any of them, whichever process the listening socket hands a request to.

Knows: one SQLite file in the server run's private directory (created by ``qserve serve``'s parent
and removed with it), the ``ResponseStore`` interface it fills (``get``, ``put``, ``delete``,
``len``), the same least-recently-used bound, and how a ``StoredResponse`` is written (the
Response object as JSON; the conversation as its messages' set fields). Nothing here needs to
outlive the run, so writes are not synced to disk. Must not know: routes, engines, how a
response is made.

Opening: the file is put in WAL mode once (it stays so). Switching a new file to WAL takes an
exclusive lock that SQLite's busy timeout does not wait for, so API servers opening a new store at
the same moment got "database is locked" at once; the parent opens it first (``prepare``), and an
open that still finds the switch under way waits for it (``BUSY_TIMEOUT_S``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time

from qserve.server.protocol import ChatMessage
from qserve.server.responses import MAX_STORED_RESPONSES, StoredResponse

BUSY_TIMEOUT_S = 5.0  # another process holds the write lock (a write takes microseconds)
# A use counter shared by the processes (a clock could give two uses the same tick).
_NEXT_USE = "(SELECT COALESCE(MAX(used), 0) + 1 FROM responses)"


class SharedResponseStore:
    """``ResponseStore``'s interface over a SQLite file several processes open."""

    def __init__(self, path: str, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self._use_wal()
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS responses "
            "(id TEXT PRIMARY KEY, response TEXT NOT NULL, conversation TEXT NOT NULL, used INTEGER NOT NULL)"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS responses_used ON responses (used)")

    @classmethod
    def prepare(cls, path: str) -> None:
        """Create the file, its table and its WAL mode before any API server opens it (the parent)."""
        cls(path).close()

    def _use_wal(self) -> None:
        """WAL mode, waiting while another connection switches the file (module doc)."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                if self._db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT response, conversation FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
            if row is None:
                return None
            self._db.execute(f"UPDATE responses SET used = {_NEXT_USE} WHERE id = ?", (response_id,))
        conversation = [ChatMessage.model_validate(m) for m in json.loads(row[1])]
        return StoredResponse(json.loads(row[0]), conversation)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        conversation = [m.model_dump(mode="json", exclude_unset=True) for m in stored.conversation]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    f"INSERT OR REPLACE INTO responses VALUES (?, ?, ?, {_NEXT_USE})",
                    (response_id, json.dumps(stored.response), json.dumps(conversation)),
                )
                self._db.execute(
                    "DELETE FROM responses WHERE id NOT IN (SELECT id FROM responses ORDER BY used DESC LIMIT ?)",
                    (self.capacity,),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
