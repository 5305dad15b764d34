"""The responses ``POST /v1/responses`` keeps (``store``, the default), for ``GET`` and
``DELETE /v1/responses/{id}`` and for requests that continue them (``previous_response_id``).

    store = ResponseStore.open(Path("~/.cache/dualpath/responses"), max_count=10_000,
                               max_bytes=1 << 30)
    store.put(StoredResponse(id, cache_salt, body, conversation))
    stored = store.get(id, cache_salt)      # None: unknown, evicted, or another tenant's
    store.delete(id, cache_salt)            # False if there was nothing to delete

Each response is kept whole: its body as ``GET`` returns it, and its conversation as chat
messages (the previous response's conversation, this request's input, this response's
output; never the request's ``instructions``, which OpenAI does not carry over). A request
that continues it sends only its new items, and its prompt is that conversation plus them,
whose KV the previous turns left in the KV store. Keeping every conversation whole costs disk
(a long agent session keeps each turn's history again), which the bounds contain.

Storage is one SQLite database (stdlib ``sqlite3``) in write-ahead-log mode, ``responses.db``
under the directory: a response is one row, written in one transaction, so a crash or a
restart keeps each response whole or not at all, and several servers may share a directory.
Bounded: after each write the oldest responses are evicted until at most ``max_count`` are
kept and their bodies and conversations total at most ``max_bytes`` (the newest is always
kept). A response is found only under the ``cache_salt`` it was created with (None for none):
a tenant never reads another's conversation.

Thread-safe: one connection behind a lock; the routes call it from worker threads (its file
I/O stays off the event loop).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DATABASE_FILE = "responses.db"
# How long a write waits for another process's transaction on a shared directory.
_BUSY_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- write order: eviction takes the lowest
    id TEXT NOT NULL UNIQUE,
    cache_salt TEXT,                        -- NULL: written without a salt
    body TEXT NOT NULL,                     -- JSON, as GET returns it
    conversation TEXT NOT NULL,             -- JSON list of chat-template messages
    size_bytes INTEGER NOT NULL
)
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    cache_salt: str | None
    body: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """See the module docstring. ``open`` creates the directory and the database."""

    def __init__(self, connection: sqlite3.Connection, *, max_count: int, max_bytes: int) -> None:
        if max_count <= 0 or max_bytes <= 0:
            raise ValueError(f"max_count and max_bytes must be > 0, got {max_count}, {max_bytes}")
        self._connection = connection
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        with self._lock, connection:
            connection.execute(_SCHEMA)

    @classmethod
    def open(cls, directory: Path | None, *, max_count: int, max_bytes: int) -> ResponseStore:
        """A store under ``directory``; None keeps responses in memory (lost on exit)."""
        if directory is None:
            path = ":memory:"
        else:
            directory = Path(directory).expanduser()
            directory.mkdir(parents=True, exist_ok=True)
            path = str(directory / DATABASE_FILE)
        connection = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, check_same_thread=False)
        if directory is not None:
            connection.execute("PRAGMA journal_mode=WAL")
            # In WAL mode: a crash of this process loses nothing committed; a power loss may
            # lose the last commits, never a response's consistency.
            connection.execute("PRAGMA synchronous=NORMAL")
        return cls(connection, max_count=max_count, max_bytes=max_bytes)

    def put(self, response: StoredResponse) -> None:
        """Keep ``response`` (replacing one of its id), then evict down to the bounds."""
        body = json.dumps(response.body, separators=(",", ":"))
        conversation = json.dumps(response.conversation, separators=(",", ":"))
        size_bytes = len(body.encode()) + len(conversation.encode())
        with self._lock, self._connection as connection:
            connection.execute(
                "INSERT OR REPLACE INTO responses (id, cache_salt, body, conversation, "
                "size_bytes) VALUES (?, ?, ?, ?, ?)",
                (response.id, response.cache_salt, body, conversation, size_bytes),
            )
            num_evicted = self._evict(connection)
        if num_evicted:
            logger.info("response store: evicted the %d oldest responses", num_evicted)

    def _evict(self, connection: sqlite3.Connection) -> int:
        num_rows, num_bytes = connection.execute(
            "SELECT COUNT(*), COALESCE(SUM(size_bytes), 0) FROM responses"
        ).fetchone()
        oldest_first = connection.execute("SELECT seq, size_bytes FROM responses ORDER BY seq")
        last_evicted_seq = None
        while num_rows > 1 and (num_rows > self.max_count or num_bytes > self.max_bytes):
            last_evicted_seq, size_bytes = oldest_first.fetchone()
            num_rows -= 1
            num_bytes -= size_bytes
        oldest_first.close()
        if last_evicted_seq is None:
            return 0
        cursor = connection.execute("DELETE FROM responses WHERE seq <= ?", (last_evicted_seq,))
        return cursor.rowcount

    def get(self, response_id: str, cache_salt: str | None) -> StoredResponse | None:
        with self._lock:
            row = self._connection.execute(
                "SELECT body, conversation FROM responses WHERE id = ? AND cache_salt IS ?",
                (response_id, cache_salt),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(response_id, cache_salt, json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str, cache_salt: str | None) -> bool:
        with self._lock, self._connection as connection:
            cursor = connection.execute(
                "DELETE FROM responses WHERE id = ? AND cache_salt IS ?", (response_id, cache_salt)
            )
        return cursor.rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return self._connection.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._connection.close()
