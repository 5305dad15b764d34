"""Our connector inside a real vLLM engine (the embedded SmolLM2 checkpoint): a request prefilled
in PE mode sends every layer's KV to a DE buffer; decoded in DE mode from that buffer alone
(vLLM's prefix cache emptied between), it gives plain vLLM's tokens; its blocks reach the store,
and a later PE-mode prefill loads them from there, layer by layer, with the same tokens.

One engine plays both roles here (a vLLM engine and its connector are process-wide, so a
second engine would need a second process): the plans, not the process, say which role a
request takes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from dualpath.engine.buffers import KVBuffer
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.hashing import block_keys

pytestmark = pytest.mark.vllm

BLOCK = 64
ENGINE_KEY = "test-connector"
NEAR_TIE_LOGPROB = 1e-3  # a first difference is accepted only where vLLM's top two are this close


@dataclass
class Served:
    engine: object
    host: object
    store: FileKVStore
    layout: object
    fingerprint: str
    next_id: int = 0

    def close(self) -> None:
        """The engine runs in this process: shut down and let go of (with the host, which
        holds its pages), it gives back about 1.8 GB that the later modules' servers need."""
        from dualpath.vllm.connector import unregister_host

        unregister_host(ENGINE_KEY)
        if self.engine is not None:
            self.engine.engine_core.shutdown()
        self.engine = self.host = None
        gc.collect()


class LocalRemote:
    """A DE buffer in this process, as a PE's RemoteBuffer sees it; it counts the Layer Blocks
    pulled and written per slot, and can fail from layer ``fail_from_layer`` on (the DE died):
    the pulls (``failing="read"``) or the sends (``failing="write"``)."""

    def __init__(
        self, buffer: KVBuffer, fail_from_layer: int | None = None, failing: str = "read"
    ) -> None:
        self.buffer = buffer
        self.fail_from_layer = fail_from_layer
        self.failing = failing
        self.num_pulled: dict[int, int] = {}
        self.num_written: dict[int, int] = {}

    def _check(self, op: str, layer: int) -> None:
        if (
            self.failing == op
            and self.fail_from_layer is not None
            and layer >= self.fail_from_layer
        ):
            from dualpath.errors import TransferError

            raise TransferError(f"the DE is gone ({op} of layer {layer})")

    def read_layer(self, slots, layer, out) -> None:
        self._check("read", layer)
        for i, slot in enumerate(slots):
            out[i] = self.buffer.layer_block(slot, layer)
            self.num_pulled[slot] = self.num_pulled.get(slot, 0) + 1

    def write_layer(self, slots, layer, data) -> None:
        self._check("write", layer)
        for i, slot in enumerate(slots):
            self.buffer.layer_block(slot, layer)[...] = data[i]
            self.num_written[slot] = self.num_written.get(slot, 0) + 1

    def flush(self) -> None:
        pass


@pytest.fixture(scope="module")
def served(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from dualpath.model.identity import checkpoint_kv_identity
    from dualpath.vllm.connector import ConnectorHost, register_host

    _, identity = checkpoint_kv_identity(smollm2_model_dir, "float32", BLOCK)
    store = FileKVStore(tmp_path_factory.mktemp("kv"), identity.layout, identity.fingerprint)
    host = ConnectorHost(identity.layout, identity.fingerprint, store=store)
    register_host(ENGINE_KEY, host)
    served = Served(None, host, store, identity.layout, identity.fingerprint)
    del host  # served holds the only reference: close() lets go of it
    try:
        served.engine = _build_engine(smollm2_model_dir)
        yield served
    finally:
        served.close()


def _build_engine(model_dir: Path) -> object:
    from dualpath.vllm.engine import VllmEngineSpec, build_engine

    return build_engine(VllmEngineSpec(model_dir, engine_key=ENGINE_KEY, max_model_len=4096))


def _prompt(num_tokens: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, num_tokens).tolist()


def _run(served: Served, prompt: list[int], max_tokens: int, plan=None, cache_salt=None):
    """(token ids, top-2 logprobs per token, num_cached_tokens) of a greedy request, salted
    with ``cache_salt`` if one is given."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from dualpath.vllm.connector import REQUEST_ID_PARAM
    from dualpath.vllm.engine import vllm_prompt

    served.next_id += 1
    extra = None
    if plan is not None:
        served.host.plans[plan.request_id] = plan
        extra = {"kv_transfer_params": {REQUEST_ID_PARAM: plan.request_id}}
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=2,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
    )
    served.engine.add_request(
        str(served.next_id), vllm_prompt(prompt, cache_salt=cache_salt), params
    )
    tokens, logprobs, num_cached = [], [], None
    while served.engine.has_unfinished_requests():
        for out in served.engine.step():
            tokens += out.outputs[0].token_ids
            logprobs += out.outputs[0].logprobs or []
            num_cached = out.num_cached_tokens
    if plan is not None:
        del served.host.plans[plan.request_id]
    return tokens, logprobs, num_cached


def _assert_same_greedy(reference, logprobs, tokens, label: str) -> int:
    """Equal, or first different where vLLM's own top two were within NEAR_TIE_LOGPROB; 1 if
    such a near tie was met, else 0."""
    if tokens == reference:
        return 0
    index = next(i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b)
    top = sorted(logprobs[index].values(), key=lambda lp: -lp.logprob)
    margin = top[0].logprob - top[1].logprob
    assert margin < NEAR_TIE_LOGPROB, (
        f"{label}: differs from plain vLLM at token {index} ({reference[index]} vs "
        f"{tokens[index]}) where vLLM's top two were {margin:.2e} apart"
    )
    return 1


def _prefill_then_decode(served: Served, prompt, reference, reference_logprobs, pe_load=None):
    """PE mode (optionally loading hits), then DE mode from the DE buffer alone; the tokens."""
    from dualpath.engine.courier import KVTransfer, LoadSource, SendTarget

    num_blocks = -(-len(prompt) // BLOCK)
    de_buffer = KVBuffer(served.layout, num_blocks * served.layout.full_block_bytes)
    de_slots = de_buffer.allocate(num_blocks)
    served.engine.reset_prefix_cache()
    pe_plan = KVTransfer(
        1, load=pe_load, send=SendTarget(LocalRemote(de_buffer), de_slots, len(prompt))
    )
    first, _, num_cached = _run(served, prompt, 1, pe_plan)
    assert pe_plan.num_sent_blocks == num_blocks
    served.engine.reset_prefix_cache()  # the DE's tokens can only come from its buffer
    freed = []
    de_plan = KVTransfer(
        2,
        load=LoadSource(de_buffer, de_slots, len(prompt)),
        persist_from_block=0,
        on_loaded=lambda: freed.append(True),
    )
    rest, _, de_cached = _run(served, prompt + first, len(reference) - 1, de_plan)
    assert de_cached == len(prompt) and de_plan.num_loaded_tokens == len(prompt)
    assert freed == [True]
    served.host.store_io.flush()
    return first + rest, num_cached


@pytest.mark.parametrize("num_prompt_tokens", [300, 1000])
def test_pe_then_de_give_plain_vllms_tokens_and_persist_the_blocks(
    served: Served, num_prompt_tokens: int
) -> None:
    prompt = _prompt(num_prompt_tokens, seed=num_prompt_tokens)
    served.engine.reset_prefix_cache()
    reference, reference_logprobs, _ = _run(served, prompt, 8)
    tokens, num_cached = _prefill_then_decode(served, prompt, reference, reference_logprobs)
    assert num_cached == 0
    _assert_same_greedy(reference, reference_logprobs, tokens, "cold")
    # The DE persisted every full block of prompt + output (the partial tail never).
    keys = block_keys(prompt + tokens[:-1], BLOCK, served.fingerprint)
    assert served.store.lookup(keys) == len(keys)

    # Warm: a PE-mode prefill loads the prompt's stored blocks from a PE buffer.
    num_hit = (len(prompt) - 1) // BLOCK
    pe_buffer = KVBuffer(served.layout, max(num_hit, 1) * served.layout.full_block_bytes)
    pe_slots = pe_buffer.allocate(num_hit)
    for key, slot in zip(keys[:num_hit], pe_slots, strict=True):
        served.store.read(key, pe_buffer.full_block(slot))
    from dualpath.engine.courier import LoadSource

    warm, num_cached = _prefill_then_decode(
        served,
        prompt,
        reference,
        reference_logprobs,
        pe_load=LoadSource(pe_buffer, pe_slots, num_hit * BLOCK),
    )
    assert num_cached == num_hit * BLOCK
    _assert_same_greedy(reference, reference_logprobs, warm, "warm")


def test_a_hit_in_vllms_prefix_cache_is_not_loaded_and_need_not_be_read(served: Served) -> None:
    """PrefixCacheProbe finds the blocks vLLM holds (its hashes are vLLM's); a load that starts
    after them gives plain vLLM's tokens; if vLLM evicted them meanwhile, nothing is loaded and
    vLLM recomputes (the same tokens)."""
    from dualpath.engine.courier import KVTransfer, LoadSource
    from dualpath.vllm.engine import PrefixCacheProbe

    probe = PrefixCacheProbe(served.engine)
    prompt = _prompt(700, seed=7)
    num_hit = (len(prompt) - 1) // BLOCK  # 10 blocks
    served.engine.reset_prefix_cache()
    assert probe.num_cached_blocks(prompt, num_hit) == 0
    reference, reference_logprobs, _ = _run(served, prompt, 6)
    assert probe.num_cached_blocks(prompt, num_hit) == num_hit
    assert probe.num_cached_blocks(prompt, 3) == 3
    assert probe.num_cached_blocks(_prompt(700, seed=8), num_hit) == 0

    # The KV of blocks 4.. in a buffer, as a PE reads it when vLLM holds blocks 0..3 (taken
    # from vLLM's own pages: the bytes a vLLM DE persists).
    first = 4
    buffer = KVBuffer(served.layout, num_hit * served.layout.full_block_bytes)
    slots = buffer.allocate(num_hit - first)
    cache = served.host.cache
    block_ids = _cached_block_ids(served, prompt, num_hit)
    for block, slot in zip(block_ids[first:], slots, strict=True):
        buffer.full_block(slot)[...] = cache.copy_full_block(block).reshape(
            buffer.full_block(slot).shape
        )

    served.engine.reset_prefix_cache()
    _run(served, prompt[: first * BLOCK + 1], 1)  # vLLM holds blocks 0..3 only
    assert probe.num_cached_blocks(prompt, num_hit) == first
    plan = KVTransfer(3, load=LoadSource(buffer, slots, num_hit * BLOCK, first))
    tokens, _, num_cached = _run(served, prompt, 6, plan)
    assert plan.num_loaded_tokens == (num_hit - first) * BLOCK
    assert num_cached == num_hit * BLOCK
    _assert_same_greedy(reference, reference_logprobs, tokens, "engine-cached + loaded")

    served.engine.reset_prefix_cache()  # evicted before the request is scheduled
    plan = KVTransfer(4, load=LoadSource(buffer, slots, num_hit * BLOCK, first))
    tokens, _, num_cached = _run(served, prompt, 6, plan)
    assert plan.num_loaded_tokens == 0 and num_cached == 0
    _assert_same_greedy(reference, reference_logprobs, tokens, "evicted, recomputed")


def test_pinned_blocks_stay_in_vllms_cache_until_unpinned(served: Served) -> None:
    """What a PE counts as held by vLLM, it pins: when vLLM needs every free block (here taken
    straight from its pool, evicting what they cached), the pinned blocks stay cached and the
    others go; pins stop at the budget's share of vLLM's blocks."""
    from dualpath.vllm.engine import PrefixCacheProbe

    probe = PrefixCacheProbe(served.engine)
    pool = served.engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    prompt = _prompt(700, seed=21)
    num_hit = (len(prompt) - 1) // BLOCK
    served.engine.reset_prefix_cache()
    _run(served, prompt, 1)
    pinned = probe.pin(prompt, 4)
    assert len(pinned) == 4 and probe.num_pinned == 4
    assert probe.pin(prompt, num_hit, max_pinned_fraction=4 / pool.num_gpu_blocks) == []
    taken = pool.get_new_blocks(pool.get_num_free_blocks())  # evicts every unpinned block
    pool.free_blocks(taken)
    assert probe.num_cached_blocks(prompt, num_hit) == 4
    probe.unpin(pinned)
    assert probe.num_pinned == 0
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    assert probe.num_cached_blocks(prompt, num_hit) == 0


def _cached_block_ids(served: Served, prompt: list[int], num_blocks: int) -> list[int]:
    """vLLM's block ids holding the prompt's first ``num_blocks`` blocks (cached)."""
    from dualpath.vllm.engine import PrefixCacheProbe

    probe = PrefixCacheProbe(served.engine)
    pool = served.engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    return [
        pool.get_cached_block(block_hash, [0])[0].block_id
        for block_hash in probe.block_hashes(prompt, num_blocks)
    ]


def test_de_side_hits_are_pulled_from_the_des_buffer_layer_by_layer_and_not_sent_back(
    served: Served,
) -> None:
    """The DE read path: blocks 0..5 of the hit in the PE buffer, 6..14 in the DE's buffer (read
    there from the store); the PE pulls each layer of the DE's blocks as vLLM reaches it and
    sends the DE only what it lacks (the PE side's blocks and the miss). The DE then decodes
    from its buffer: plain vLLM's tokens. A pull that fails (the DE died) fails the request,
    and vLLM keeps none of what it loaded: the prompt served next gives the same tokens."""
    from dualpath.engine.courier import KVTransfer, LoadSource, RemoteBlocks, SendTarget
    from dualpath.vllm.engine import PrefixCacheProbe

    prompt = _prompt(1000, seed=11)
    served.engine.reset_prefix_cache()
    # Plain vLLM's tokens; the run persists the prompt's blocks, as a DE would.
    reference, reference_logprobs, _ = _run(served, prompt, 8, KVTransfer(5, persist_from_block=0))
    served.host.store_io.flush()
    num_blocks, num_hit, num_pe = -(-len(prompt) // BLOCK), (len(prompt) - 1) // BLOCK, 6
    keys = block_keys(prompt[: num_hit * BLOCK], BLOCK, served.fingerprint)
    layout = served.layout

    def buffers():
        pe_buffer = KVBuffer(layout, num_pe * layout.full_block_bytes)
        pe_slots = pe_buffer.allocate(num_pe)
        de_buffer = KVBuffer(layout, num_blocks * layout.full_block_bytes)
        de_slots = de_buffer.allocate(num_blocks)
        for key, slot in zip(keys[:num_pe], pe_slots, strict=True):
            served.store.read(key, pe_buffer.full_block(slot))
        for key, slot in zip(keys[num_pe:], de_slots[num_pe:num_hit], strict=True):
            served.store.read(key, de_buffer.full_block(slot))
        return pe_buffer, pe_slots, de_buffer, de_slots

    held = range(num_pe, num_hit)

    def pe_plan_of(request_id, pe_buffer, pe_slots, remote, de_slots) -> KVTransfer:
        """The PE's plan: blocks 0..5 from its buffer, the rest of the hit pulled from the
        DE's, every block but the DE's own sent to the DE."""
        return KVTransfer(
            request_id,
            load=LoadSource(
                pe_buffer,
                pe_slots,
                num_hit * BLOCK,
                remote=RemoteBlocks(remote, de_slots[num_pe:num_hit], num_pe),
            ),
            send=SendTarget(remote, de_slots, len(prompt), held),
        )

    pe_buffer, pe_slots, de_buffer, de_slots = buffers()
    de_side = de_buffer.array[de_slots[num_pe:num_hit]].copy()
    remote = LocalRemote(de_buffer)
    served.engine.reset_prefix_cache()
    pe_plan = pe_plan_of(1, pe_buffer, pe_slots, remote, de_slots)
    first, _, num_cached = _run(served, prompt, 1, pe_plan)
    assert num_cached == num_hit * BLOCK and pe_plan.transfer_error is None
    assert pe_plan.num_loaded_tokens == num_hit * BLOCK
    layers = layout.num_layers
    assert remote.num_pulled == {slot: layers for slot in de_slots[num_pe:num_hit]}
    assert remote.num_written == {
        slot: layers for slot in [*de_slots[:num_pe], *de_slots[num_hit:]]
    }
    assert np.array_equal(de_buffer.array[de_slots[num_pe:num_hit]], de_side)  # untouched

    served.engine.reset_prefix_cache()  # the DE's tokens can only come from its buffer
    de_plan = KVTransfer(2, load=LoadSource(de_buffer, de_slots, len(prompt)))
    rest, _, _ = _run(served, prompt + first, len(reference) - 1, de_plan)
    _assert_same_greedy(reference, reference_logprobs, first + rest, "DE read path")

    # The DE dies while the PE is at layer 10, found by a pull or first by a send (the pulls
    # of the layers after it are then not made): the request fails, vLLM keeps nothing of it.
    for failing in ("read", "write"):
        pe_buffer, pe_slots, de_buffer, de_slots = buffers()
        dead = LocalRemote(de_buffer, fail_from_layer=10, failing=failing)
        served.engine.reset_prefix_cache()
        failed_plan = pe_plan_of(3, pe_buffer, pe_slots, dead, de_slots)
        _run(served, prompt, 1, failed_plan)
        assert failed_plan.transfer_error is not None, failing
        # vLLM's prefix cache kept none of the blocks not wholly pulled (nor any after them).
        num_kept = PrefixCacheProbe(served.engine).num_cached_blocks(prompt, num_hit)
        assert num_kept <= num_pe, f"{failing} failed: vLLM kept {num_kept} blocks"
        after, after_logprobs, _ = _run(served, prompt, 8)
        _assert_same_greedy(reference, reference_logprobs, after, f"after a failed {failing}")


def test_a_salted_request_is_cached_and_persisted_in_its_salts_namespace_only(
    served: Served,
) -> None:
    """vLLM's prefix cache keeps a salted request's blocks apart (PrefixCacheProbe hashes the
    salt as vLLM does), and the connector persists them under the salt's store keys
    (``request.cache_salt``): another salt, or none, finds nothing of them in either."""
    from dualpath.engine.courier import KVTransfer
    from dualpath.vllm.engine import PrefixCacheProbe

    probe = PrefixCacheProbe(served.engine)
    prompt = _prompt(300, seed=31)
    num_hit = (len(prompt) - 1) // BLOCK  # 4 blocks
    served.engine.reset_prefix_cache()
    plan = KVTransfer(6, persist_from_block=0)
    tokens, logprobs, num_cached = _run(served, prompt, 4, plan, cache_salt="tenant-a")
    served.host.store_io.flush()
    assert num_cached == 0
    salted_keys = block_keys(prompt + tokens[:-1], BLOCK, served.fingerprint, cache_salt="tenant-a")
    assert plan.persisted_keys == salted_keys
    assert served.store.lookup(salted_keys) == len(salted_keys)
    assert served.store.lookup(block_keys(prompt, BLOCK, served.fingerprint)) == 0

    assert probe.num_cached_blocks(prompt, num_hit, "tenant-a") == num_hit
    assert probe.num_cached_blocks(prompt, num_hit, "tenant-b") == 0
    assert probe.num_cached_blocks(prompt, num_hit) == 0
    other, _, other_cached = _run(served, prompt, 4, cache_salt="tenant-b")
    plain, _, plain_cached = _run(served, prompt, 4)
    again, _, again_cached = _run(served, prompt, 4, cache_salt="tenant-a")
    assert (other_cached, plain_cached, again_cached) == (0, 0, num_hit * BLOCK)
    for label, run_tokens in (("tenant-b", other), ("unsalted", plain), ("again", again)):
        _assert_same_greedy(tokens, logprobs, run_tokens, label)


def test_a_served_request_salted_otherwise_than_placed_is_refused() -> None:
    """In a vLLM server, a request is loaded only if it is the one placed: its prompt and its
    cache salt (the blocks were read under the placed salt's keys)."""
    from types import SimpleNamespace

    from dualpath.vllm.connector import PlanView
    from dualpath.vllm.served_scheduler import _mismatch

    view = PlanView(9, prompt_token_ids=(1, 2, 3), cache_salt="tenant-a")
    assert (
        _mismatch(view, SimpleNamespace(prompt_token_ids=[1, 2, 3], cache_salt="tenant-a")) is None
    )
    for salt in (None, "", "tenant-b"):
        request = SimpleNamespace(prompt_token_ids=[1, 2, 3], cache_salt=salt)
        assert "cache_salt" in _mismatch(view, request)
    unsalted = PlanView(9, prompt_token_ids=(1, 2, 3))
    assert _mismatch(unsalted, SimpleNamespace(prompt_token_ids=[1, 2, 3], cache_salt="")) is None
    assert "prompt" in _mismatch(
        unsalted, SimpleNamespace(prompt_token_ids=[1, 2], cache_salt=None)
    )


def test_the_quota_batchers_predictor_is_profiled_on_vllm_and_leaves_it_empty(
    served: Served,
) -> None:
    """``--vllm-prefill-batching quota``'s predictor: the native PE's profile batches run
    through vLLM (cached tokens in its prefix cache); more work never predicts less time, and
    the engine is idle with nothing of the profile in its prefix cache after."""
    from dualpath.vllm.engine import PrefixCacheProbe, profile_vllm_layer_time

    prompt = _prompt(300, seed=3)
    _run(served, prompt, 1)
    probe = PrefixCacheProbe(served.engine)
    assert probe.num_cached_blocks(prompt, 4) == 4
    predictor = profile_vllm_layer_time(
        served.engine, max_context_tokens=512, num_layers=served.layout.num_layers, num_repeats=1
    )
    assert not served.engine.has_unfinished_requests()
    assert probe.num_cached_blocks(prompt, 4) == 0  # emptied
    small, large = predictor.predict_s([(0, 64)]), predictor.predict_s([(256, 512)])
    assert 0 < small <= large
