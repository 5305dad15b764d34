"""The store of /v1/responses (dualpath/server/response_store.py): kept whole across a reopen,
found only under its cache salt, bounded by count and bytes with the oldest evicted first."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from dualpath.server.response_store import DATABASE_FILE, ResponseStore, StoredResponse

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1.5}}}
        ],
    },
]


def stored(response_id: str, cache_salt: str | None = None, *, padding: int = 0) -> StoredResponse:
    body = {"id": response_id, "object": "response", "padding": "x" * padding}
    return StoredResponse(response_id, cache_salt, body, CONVERSATION)


def open_store(path: Path | None, **bounds: int) -> ResponseStore:
    return ResponseStore.open(path, **{"max_count": 100, "max_bytes": 1 << 20, **bounds})


@pytest.mark.parametrize("in_memory", [True, False])
def test_a_response_comes_back_as_it_was_put(tmp_path: Path, in_memory: bool) -> None:
    store = open_store(None if in_memory else tmp_path)
    store.put(stored("resp_1"))
    assert store.get("resp_1", None) == stored("resp_1")
    assert store.get("resp_2", None) is None


def test_responses_outlive_a_reopen(tmp_path: Path) -> None:
    store = open_store(tmp_path / "responses")
    store.put(stored("resp_1", "tenant"))
    store.close()
    reopened = open_store(tmp_path / "responses")
    assert reopened.get("resp_1", "tenant") == stored("resp_1", "tenant")
    with sqlite3.connect(tmp_path / "responses" / DATABASE_FILE) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_response_is_found_only_under_its_salt(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put(stored("resp_a", "a"))
    store.put(stored("resp_none"))
    assert store.get("resp_a", None) is None and store.get("resp_a", "b") is None
    assert store.get("resp_none", "a") is None
    assert store.get("resp_a", "a") is not None and store.get("resp_none", None) is not None
    assert not store.delete("resp_a", None)
    assert store.delete("resp_a", "a")
    assert not store.delete("resp_a", "a")
    assert store.get("resp_a", "a") is None and len(store) == 1


def test_the_oldest_are_evicted_beyond_the_count(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_count=3)
    for i in range(5):
        store.put(stored(f"resp_{i}"))
    kept = [i for i in range(5) if store.get(f"resp_{i}", None) is not None]
    assert kept == [2, 3, 4]


def test_a_rewritten_response_counts_as_new(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_count=2)
    store.put(stored("resp_0"))
    store.put(stored("resp_1"))
    store.put(stored("resp_0", padding=1))  # replaced: now the newest
    store.put(stored("resp_2"))
    assert store.get("resp_1", None) is None
    assert store.get("resp_0", None) == stored("resp_0", padding=1)
    assert len(store) == 2


def test_the_oldest_are_evicted_beyond_the_bytes_and_the_newest_is_kept(tmp_path: Path) -> None:
    size_bytes = _size_bytes(tmp_path / "probe", stored("resp_0", padding=1000))
    store = open_store(tmp_path / "bounded", max_bytes=2 * size_bytes + size_bytes // 2)
    for i in range(4):
        store.put(stored(f"resp_{i}", padding=1000))
    assert [i for i in range(4) if store.get(f"resp_{i}", None)] == [2, 3]
    store.put(stored("resp_big", padding=10 * size_bytes))  # alone over the bound: kept alone
    assert store.get("resp_big", None) is not None and len(store) == 1


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_count"):
        open_store(None, max_count=0)


def _size_bytes(path: Path, response: StoredResponse) -> int:
    store = open_store(path)
    store.put(response)
    with sqlite3.connect(path / DATABASE_FILE) as connection:
        return connection.execute("SELECT size_bytes FROM responses").fetchone()[0]


def test_serve_keeps_responses_under_its_home_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dualpath.cli.serve import _serve_server_config
    from tests.server.test_args import serve_settings

    monkeypatch.setenv("DUALPATH_HOME", str(tmp_path / "home"))
    config = _serve_server_config(serve_settings(), tmp_path / "model")
    assert config.responses_dir == tmp_path / "home" / "responses"
    assert (config.responses_max_count, config.responses_max_bytes) == (10_000, 10**9)
    flags = (
        "--responses-dir",
        "/data/r",
        "--responses-max-count",
        "5",
        "--responses-max-gb",
        "0.5",
    )
    config = _serve_server_config(serve_settings(*flags), tmp_path / "model")
    assert (config.responses_dir, config.responses_max_count) == (Path("/data/r"), 5)
    assert config.responses_max_bytes == 500_000_000
