"""The vLLM roles' ``PrefillHeld`` exchange, driven without vLLM (fake engines, a memory
store): a DE waits for the PE's word before its side's reads only where the Assignment says
the PE sends it (``is_prefill_held_sent``); a PE sends it exactly there. And both read, and
ask vLLM's prefix cache, in the Assignment's cache salt's namespace only. A DE placed while it
steps sends ``DecodeReady`` from the step's between-layers hook, not after the step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dualpath.engine.buffers import KVBuffer
from dualpath.kv.hashing import block_keys
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import MemoryKVStore
from dualpath.protocol import Assignment, DecodeReady, PrefillHeld
from dualpath.transfer.traffic import direct_move
from dualpath.vllm.decode import VllmDecodeRole
from dualpath.vllm.prefill import VllmPrefillRole

LAYOUT = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=8)
FINGERPRINT = "0" * 32
PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks of 4, then 1 token


def _assignment(
    *, is_prefill_held_sent: bool, cache_salt: str | None = None, request_id: int = 7
) -> Assignment:
    """Hit blocks 0 (PE side), 1 and 2 (DE side)."""
    return Assignment(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling={},
        num_prefill_side_blocks=1,
        num_decode_side_blocks=2,
        prefill_engine_id=0,
        decode_engine_id=1,
        is_prefill_held_sent=is_prefill_held_sent,
        cache_salt=cache_salt,
    )


def _host(store: MemoryKVStore | None) -> SimpleNamespace:
    """The fields of a ``ConnectorHost`` the roles read."""
    return SimpleNamespace(
        layout=LAYOUT, fingerprint=FINGERPRINT, store=store, mover=direct_move, store_io=None
    )


class _Engine:
    """A vLLM engine that never has a request to step."""

    def __init__(self, prefix_cache: object = None) -> None:
        self.block_pool = SimpleNamespace(num_gpu_blocks=16, get_num_free_blocks=lambda: 16)
        self.prefix_cache = prefix_cache

    def has_unfinished_requests(self) -> bool:
        return False


class _PrefixCache:
    """vLLM's prefix cache holding the prompt's first ``num_held`` blocks."""

    def __init__(self, num_held: int, *, enabled: bool = True) -> None:
        self.num_held = num_held
        self.enabled = enabled
        self.max_blocks_asked: list[int] = []
        self.salts_asked: list[str | None] = []

    def pin(self, prompt: list[int], max_blocks: int, *, cache_salt: str | None = None) -> list:
        self.max_blocks_asked.append(max_blocks)
        self.salts_asked.append(cache_salt)
        return [object()] * min(self.num_held, max_blocks)

    def unpin(self, pinned: list) -> None:
        pass


def _write_prompt(store: MemoryKVStore, cache_salt: str | None = None) -> None:
    for key in block_keys(PROMPT[:12], 4, FINGERPRINT, cache_salt=cache_salt):
        store.write(key, np.full(LAYOUT.full_block_shape, 3, dtype=np.uint8))


@pytest.fixture
def store() -> MemoryKVStore:
    """The prompt's three full blocks, unsalted."""
    store = MemoryKVStore(LAYOUT, FINGERPRINT)
    _write_prompt(store)
    return store


@pytest.fixture
def decode(store: MemoryKVStore):
    role = VllmDecodeRole(
        _Engine(),
        _host(store),
        KVBuffer(LAYOUT, 8 * LAYOUT.full_block_bytes),
        wake=lambda: None,
        eos_token_ids=(),
        num_io_threads=1,
    )
    yield role
    role.close(flush_timeout_s=1.0)


def _work(role: VllmDecodeRole | VllmPrefillRole) -> list[object]:
    sent: list[object] = []
    role.work(sent.append, lambda: None)
    return sent


def test_a_de_whose_pe_reports_nothing_reads_at_once(decode: VllmDecodeRole) -> None:
    decode.add(_assignment(is_prefill_held_sent=False))
    request = decode.requests[7]
    assert request.reads is not None  # started in ``add``: no PrefillHeld awaited
    assert request.reads.result() == 2
    (ready,) = _work(decode)
    assert ready == DecodeReady(7, tuple(request.slots), 2)
    assert decode.num_read_bytes == 2 * LAYOUT.full_block_bytes


class _SteppingEngine(_Engine):
    """An engine with one request in one step, whose connector calls the host's
    between-layers hook after each layer, as vLLM saves each layer's KV."""

    def __init__(self, host: SimpleNamespace) -> None:
        super().__init__()
        self.host = host
        self.num_steps = 0

    def has_unfinished_requests(self) -> bool:
        return self.num_steps == 0

    def step(self) -> list:
        self.num_steps += 1
        for _ in range(LAYOUT.num_layers):
            if self.host.between_layers is not None:
                self.host.between_layers()
        return []


def test_a_de_placed_mid_step_tells_its_pe_before_the_step_ends(store: MemoryKVStore) -> None:
    host = _host(store)
    host.between_layers = None
    engine = _SteppingEngine(host)
    decode = VllmDecodeRole(
        engine,
        host,
        KVBuffer(LAYOUT, 8 * LAYOUT.full_block_bytes),
        wake=lambda: None,
        eos_token_ids=(),
        num_io_threads=1,
    )

    def between_layers() -> None:  # the engine process hands over an Assignment that came
        if 7 not in decode.requests:
            decode.add(_assignment(is_prefill_held_sent=False))
            decode.requests[7].reads.result()  # read before the next layer

    sent: list[object] = []
    try:
        assert decode.work(sent.append, between_layers)
    finally:
        decode.close(flush_timeout_s=1.0)
    assert engine.num_steps == 1
    assert sent == [DecodeReady(7, tuple(decode.requests[7].slots), 2)]
    assert host.between_layers is None  # the hook is the step's only


def test_a_de_whose_pe_reports_waits_for_it_and_skips_what_it_holds(
    decode: VllmDecodeRole,
) -> None:
    decode.add(_assignment(is_prefill_held_sent=True))
    request = decode.requests[7]
    assert request.reads is None
    assert _work(decode) == []  # not ready: nothing read yet
    decode.on_peer_message(PrefillHeld(7, 2))  # the PE's vLLM holds blocks 0 and 1
    assert request.reads is not None
    assert request.reads.result() == 1  # block 2 only
    (ready,) = _work(decode)
    assert ready == DecodeReady(7, tuple(request.slots), 2)  # block 1 held, block 2 read
    assert decode.num_read_bytes == LAYOUT.full_block_bytes


def _prefill(store: MemoryKVStore, prefix_cache: _PrefixCache) -> VllmPrefillRole:
    return VllmPrefillRole(
        _Engine(prefix_cache),
        _host(None),
        KVBuffer(LAYOUT, 8 * LAYOUT.full_block_bytes),
        SimpleNamespace(remotes={}),
        store=store,
        mover=direct_move,
        wake=lambda: None,
        eos_token_ids=(),
        num_io_threads=1,
    )


@pytest.mark.parametrize("is_sent", [True, False])
def test_a_pe_sends_prefill_held_exactly_where_the_assignment_says(
    store: MemoryKVStore, is_sent: bool
) -> None:
    prefix_cache = _PrefixCache(num_held=2)
    role = _prefill(store, prefix_cache)
    assert role.reports_prefill_held  # what its EngineInfo says
    try:
        role.add(_assignment(is_prefill_held_sent=is_sent))
        sent = [m for m in _work(role) if isinstance(m, PrefillHeld)]
        request = role.requests[7]
    finally:
        role.close(flush_timeout_s=1.0)
    if is_sent:
        assert sent == [PrefillHeld(7, 2)]
        assert prefix_cache.max_blocks_asked == [3]
        assert request.num_engine_cached_blocks == 2
    else:  # the DE reads its side whatever vLLM holds: only the PE side's hit may be held
        assert sent == []
        assert prefix_cache.max_blocks_asked == [1]
        assert request.num_engine_cached_blocks == 1


def test_a_pe_that_does_not_probe_vllms_cache_says_it_reports_nothing(
    store: MemoryKVStore,
) -> None:
    role = _prefill(store, _PrefixCache(num_held=0, enabled=False))
    try:
        assert not role.reports_prefill_held
    finally:
        role.close(flush_timeout_s=1.0)


def test_a_salted_de_reads_its_salts_blocks_and_never_the_unsalted_ones(
    store: MemoryKVStore, decode: VllmDecodeRole
) -> None:
    salted_keys = block_keys(PROMPT[:12], 4, FINGERPRINT, cache_salt="tenant-a")
    decode.add(_assignment(is_prefill_held_sent=False, cache_salt="tenant-a"))
    request = decode.requests[7]
    assert request.keys == salted_keys[1:3]  # the DE side's hit blocks, under the salt
    assert request.reads.result() == 0  # the store holds this prompt unsalted only
    _write_prompt(store, "tenant-a")
    decode.add(_assignment(is_prefill_held_sent=False, cache_salt="tenant-a", request_id=8))
    assert decode.requests[8].reads.result() == 2


def test_a_salted_pe_asks_vllms_cache_and_reads_the_store_under_the_salt(
    store: MemoryKVStore,
) -> None:
    prefix_cache = _PrefixCache(num_held=0)
    role = _prefill(store, prefix_cache)
    try:
        role.add(_assignment(is_prefill_held_sent=True, cache_salt="tenant-a"))
        request = role.requests[7]
        assert prefix_cache.salts_asked == ["tenant-a"]
        assert request.keys == block_keys(PROMPT[:4], 4, FINGERPRINT, cache_salt="tenant-a")
        assert request.reads.result() == 0  # the unsalted block 0 is not this tenant's
        role.add(_assignment(is_prefill_held_sent=True, request_id=8))
        assert prefix_cache.salts_asked == ["tenant-a", None]
        assert role.requests[8].reads.result() == 1
    finally:
        role.close(flush_timeout_s=1.0)
