"""PE and DE engines in one process, joined by a local DE buffer: the tokens must equal the
single-node engine's whichever side read the hit KV (SPEC §2 correctness)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from dualpath import LLM, SamplingParams
from dualpath.config import EngineConfig, KVStoreConfig
from dualpath.engine.buffers import KVBuffer
from dualpath.engine.decode import DecodeEngine
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.prefill import PrefillEngine
from dualpath.engine.remote_buffer import TransportRemoteBuffer, TransportStaging
from dualpath.errors import TransferTimeout
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.hashing import block_keys
from dualpath.model.identity import kv_identity
from dualpath.model.loader import load_model
from dualpath.protocol import Assignment
from dualpath.scheduler.attention_predictor import ConstantAttentionTimePredictor
from dualpath.scheduler.batching import PrefillBatcher
from dualpath.transfer.transport import FakeNetwork, FakeTransport
from dualpath.types import sampling_params_to_dict
from tests.helpers import assert_same_tokens

BLOCK = 64


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class LocalRemoteBuffer:
    """A ``RemoteBuffer`` over a DE buffer in this process: plain copies, no transport."""

    def __init__(self, buffer: KVBuffer) -> None:
        self.buffer = buffer

    def read_layer(self, slots: Sequence[int], layer: int, out: np.ndarray) -> None:
        for i, slot in enumerate(slots):
            out[i] = self.buffer.layer_block(slot, layer)

    def write_layer(self, slots: Sequence[int], layer: int, data: np.ndarray) -> None:
        for i, slot in enumerate(slots):
            self.buffer.layer_block(slot, layer)[...] = data[i]

    def flush(self) -> None:
        """Writes land as they are made."""


class Pair:
    """One PE and one DE sharing a store, driven by hand through the real message types."""

    def __init__(
        self,
        model_dir: Path,
        store_dir: Path,
        *,
        is_layerwise: bool,
        remote: str = "local",
        batcher: PrefillBatcher | None = None,
    ) -> None:
        loaded = load_model(model_dir)
        self.identity = kv_identity(loaded.config, loaded.weights_digest, "float32", BLOCK)
        store = FileKVStore(store_dir, self.identity.layout, self.identity.fingerprint)
        self.prefill = PrefillEngine(
            loaded.model,
            self.identity,
            store,
            KVBuffer(self.identity.layout, 32 << 20),
            dtype=loaded.dtype,
            device=loaded.device,
            is_layerwise=is_layerwise,
            batcher=batcher,
        )
        engine = LLMEngine(loaded, EngineConfig(), KVStoreConfig(root_dir=store_dir))
        self.decode = DecodeEngine(engine, KVBuffer(self.identity.layout, 32 << 20))
        self.remote = LocalRemoteBuffer(self.decode.buffer)
        if remote == "transport":
            # The real transport interface over in-process buffers; a 3-block write ring
            # forces wrap-arounds and waits on in-flight writes.
            network = FakeNetwork()
            pe_side, de_side = FakeTransport("pe", network), FakeTransport("de", network)
            descriptor = de_side.register("de-buffer", self.decode.buffer.array)
            pe_side.connect("de", de_side.metadata())
            staging = TransportStaging(
                pe_side, self.identity.layout, max_read_blocks=2, ring_blocks=3
            )
            self.remote = TransportRemoteBuffer(staging, "de", descriptor, timeout_s=5.0)
        self.store = store
        self.next_id = 0
        self.batches: list[list[tuple[int, int]]] = []  # (request id, new tokens) per batch
        self.num_between_layers = 0
        self.late_added_in_batch = 0  # which batch (1-based) took the late requests

    def num_stored_blocks(self, prompt: list[int]) -> int:
        keys = block_keys(
            prompt[: (len(prompt) - 1) // BLOCK * BLOCK], BLOCK, self.identity.fingerprint
        )
        return self.store.lookup(keys)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        split,
        *,
        num_late: int = 0,
    ) -> list[dict]:
        """Every prompt's tokens; the last ``num_late`` prompts arrive while the first batch
        computes (between its layers, as an engine process takes messages)."""
        assignments = []
        for prompt in prompts:
            num_hit = self.num_stored_blocks(prompt)
            num_pe = split(num_hit)
            assignments.append(
                Assignment(
                    self.next_id,
                    tuple(prompt),
                    sampling_params_to_dict(params),
                    num_pe,
                    num_hit - num_pe,
                    0,
                    1,
                )
            )
            self.next_id += 1
        late = assignments[len(assignments) - num_late :]

        def add(to_add: list[Assignment]) -> None:
            for a in to_add:
                self.decode.add(a)
                self.prefill.add(a)

        def between_layers() -> None:
            self.num_between_layers += 1
            if late and not self.late_added_in_batch:
                add(late)
                self.late_added_in_batch = sum(1 for b in self.batches if b)

        add(assignments[: len(assignments) - num_late])
        results = {a.request_id: {"token_ids": [], "cached": None} for a in assignments}
        pending = set(results)
        while pending:
            for ready in self.decode.poll_ready():
                self.prefill.on_decode_ready(ready)
            batch = self.prefill.next_batch(lambda de: self.remote)
            self.batches.append([(r.request_id, c.num_new_tokens) for r, c in batch])
            if batch:
                outcome = self.prefill.run_batch(batch, between_layers)
                assert not outcome.failed
                for done in outcome.done:
                    results[done.request_id]["token_ids"].append(done.first_token_id)
                    results[done.request_id]["cached"] = done.num_cached_tokens
                    self.decode.on_prefill_done(done)
            for update in self.decode.step():
                results[update.request_id]["token_ids"] += update.token_ids
                if update.finish_reason is not None:
                    pending.discard(update.request_id)
        self.decode.engine.flush()
        assert self.decode.buffer.num_used_bytes == 0 and self.prefill.buffer.num_used_bytes == 0
        return [results[a.request_id] for a in assignments]


class _Out:
    def __init__(self, token_ids, logprobs=None) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs


SPLITS = {
    "pe": lambda n: n,
    "de": lambda n: 0,
    "split": lambda n: n // 2,
}


@pytest.mark.parametrize(
    ("side", "layerwise", "remote"),
    [
        (side, layerwise, remote)
        for side in SPLITS
        for layerwise in (True, False)
        for remote in ("local", "transport")
        if remote == "local" or layerwise
    ],
)
def test_tokens_match_single_node_on_every_read_path(
    tiny_model_dir: Path, tmp_path: Path, side: str, layerwise: bool, remote: str
) -> None:
    _check_read_path(tiny_model_dir, tmp_path, side, layerwise, remote)


@pytest.mark.parametrize("side", list(SPLITS))
def test_mla_tokens_match_single_node_on_every_read_path(
    tiny_deepseek_dir: Path, tmp_path: Path, side: str
) -> None:
    """DeepSeek-V3.2's latent entries (with the indexer's keys) through the same paths."""
    _check_read_path(tiny_deepseek_dir, tmp_path, side, layerwise=True, remote="transport")


def _check_read_path(
    model_dir: Path, tmp_path: Path, side: str, layerwise: bool, remote: str
) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    turn1 = [random_ids(n, seed=n) for n in (130, 64, 200)]
    with LLM(model_dir, kv_store=tmp_path / "kv") as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in turn1], params)
    turn2 = [p + o.token_ids + random_ids(37, seed=9) for p, o in zip(turn1, first, strict=True)]
    with LLM(model_dir) as llm:  # no store: a full recompute
        reference = llm.generate([{"prompt_token_ids": p} for p in turn2], params)

    pair = Pair(model_dir, tmp_path / "kv", is_layerwise=layerwise, remote=remote)
    results = pair.generate(turn2, params, SPLITS[side])
    for p1, o1, ref, got, prompt in zip(turn1, first, reference, results, turn2, strict=True):
        expected_hit = BLOCK * ((len(p1) + len(o1.token_ids) - 1) // BLOCK)
        assert got["cached"] == expected_hit
        assert_same_tokens(ref, _Out(got["token_ids"]), label=f"{side} path, prompt {len(prompt)}")
    # Turn 3 finds turn 2's blocks, persisted by the DE (prompt blocks and output blocks).
    turn3 = [p + r["token_ids"] + [5, 6, 7] for p, r in zip(turn2, results, strict=True)]
    for prompt, got in zip(turn3, turn2, strict=True):
        stored = pair.num_stored_blocks(prompt)
        assert stored == (len(got) + params.max_tokens - 1) // BLOCK


@pytest.mark.parametrize(
    ("model", "side"), [("tiny", "pe"), ("tiny", "de"), ("tiny", "split"), ("deepseek", "split")]
)
def test_chunked_prefill_across_batches_gives_the_same_tokens(
    tiny_model_dir: Path, tiny_deepseek_dir: Path, tmp_path: Path, model: str, side: str
) -> None:
    """A quota of 128 new tokens per batch cuts long prompts at block boundaries; the chunks
    attend over the hit KV and the earlier chunks, and the tokens stay the same."""
    model_dir = tiny_deepseek_dir if model == "deepseek" else tiny_model_dir
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    turn1 = [random_ids(n, seed=n) for n in (150, 70)]
    with LLM(model_dir, kv_store=tmp_path / "kv") as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in turn1], params)
    turn2 = [p + o.token_ids + random_ids(300, seed=3) for p, o in zip(turn1, first, strict=True)]
    with LLM(model_dir) as llm:
        reference = llm.generate([{"prompt_token_ids": p} for p in turn2], params)

    batcher = PrefillBatcher(
        ConstantAttentionTimePredictor(seconds_per_new_token=1.0),
        quota_s=128.0,
        min_chunk_tokens=BLOCK,
        chunk_align_tokens=BLOCK,
    )
    pair = Pair(model_dir, tmp_path / "kv", is_layerwise=True, batcher=batcher)
    results = pair.generate(turn2, params, SPLITS[side])
    for ref, got, prompt in zip(reference, results, turn2, strict=True):
        assert_same_tokens(ref, _Out(got["token_ids"]), label=f"chunked, prompt {len(prompt)}")
    batches = [b for b in pair.batches if b]
    # Every batch keeps to 128 new tokens, and each request was computed in several chunks.
    assert all(sum(n for _, n in batch) <= 128 for batch in batches)
    for request_id, prompt, got in zip((0, 1), turn2, results, strict=True):
        chunks = [n for batch in batches for r, n in batch if r == request_id]
        assert len(chunks) >= 2
        assert sum(chunks) == len(prompt) - got["cached"]
        assert all(n % BLOCK == 0 for n in chunks[:-1])


def test_requests_added_between_layers_start_reading_and_give_the_same_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An engine process takes new requests between the layers of a batch, so their PE-side
    reads overlap its compute; the running batch and the late requests keep their tokens."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    turn1 = [random_ids(n, seed=n) for n in (140, 90, 210)]
    with LLM(tiny_model_dir, kv_store=tmp_path / "kv") as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in turn1], params)
    turn2 = [p + o.token_ids + random_ids(50, seed=7) for p, o in zip(turn1, first, strict=True)]
    with LLM(tiny_model_dir) as llm:
        reference = llm.generate([{"prompt_token_ids": p} for p in turn2], params)

    pair = Pair(tiny_model_dir, tmp_path / "kv", is_layerwise=True)
    results = pair.generate(turn2, params, SPLITS["split"], num_late=2)
    for ref, got, prompt in zip(reference, results, turn2, strict=True):
        assert got["cached"] > 0
        assert_same_tokens(ref, _Out(got["token_ids"]), label=f"late, prompt {len(prompt)}")
    # The late requests were added during the first batch, and computed in a later one.
    batches = [b for b in pair.batches if b]
    assert pair.late_added_in_batch == 1
    assert [r for r, _ in batches[0]] == [0]
    assert {r for b in batches[1:] for r, _ in b} == {1, 2}
    num_layers = pair.prefill.model.num_layers
    assert pair.num_between_layers == len(batches) * (num_layers - 1)


class _RecordingRemote:
    """A local DE buffer that records when each layer's DE-side hit KV is read."""

    def __init__(self, inner: LocalRemoteBuffer) -> None:
        self.inner = inner
        self.layers_read: list[int] = []
        self.read_started = threading.Condition()

    def read_layer(self, slots, layer, out) -> None:
        with self.read_started:
            self.layers_read.append(layer)
            self.read_started.notify_all()
        self.inner.read_layer(slots, layer, out)

    def write_layer(self, slots, layer, data) -> None:
        self.inner.write_layer(slots, layer, data)

    def flush(self) -> None:
        self.inner.flush()


def test_the_next_layers_hit_kv_loads_while_this_layer_computes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = random_ids(200, seed=4)
    with LLM(tiny_model_dir, kv_store=tmp_path / "kv") as llm:
        first = llm.generate([{"prompt_token_ids": prompt}], params)
    pair = Pair(tiny_model_dir, tmp_path / "kv", is_layerwise=True)
    remote = _RecordingRemote(pair.remote)
    pair.remote = remote
    model = pair.prefill.model
    num_layers = model.num_layers
    forward_layer = model.forward_layer
    overlapped = []

    def forward_waiting_for_the_next_load(layer, *args):
        # Layer l may finish only once layer l+1's load has begun: without prefetching,
        # that load would start after this returns, and the wait would time out.
        with remote.read_started:
            overlapped.append(
                layer + 1 == num_layers
                or remote.read_started.wait_for(lambda: layer + 1 in remote.layers_read, 10.0)
            )
        return forward_layer(layer, *args)

    model.forward_layer = forward_waiting_for_the_next_load
    try:
        pair.generate([prompt + first[0].token_ids + [1, 2, 3]], params, SPLITS["de"])
    finally:
        model.forward_layer = forward_layer
    # The PE's prefill comes first (the DE's decode steps share the model and follow).
    assert overlapped[:num_layers] == [True] * num_layers
    assert remote.layers_read == list(range(num_layers))


class _TimingOutRemote(_RecordingRemote):
    """Times out the first write of ``failing_layer`` (a DE that stopped answering)."""

    def __init__(self, inner: LocalRemoteBuffer, failing_layer: int) -> None:
        super().__init__(inner)
        self.failing_layer = failing_layer
        self.has_failed = False

    def write_layer(self, slots, layer, data) -> None:
        if layer == self.failing_layer and not self.has_failed:
            self.has_failed = True
            raise TransferTimeout(f"write of layer {layer} timed out")
        super().write_layer(slots, layer, data)


@pytest.mark.parametrize("side", ["pe", "de"])
def test_a_transfer_timing_out_mid_layer_frees_both_buffers(
    tiny_model_dir: Path, tmp_path: Path, side: str
) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    turn1 = random_ids(200, seed=6)
    with LLM(tiny_model_dir, kv_store=tmp_path / "kv") as llm:
        first = llm.generate([{"prompt_token_ids": turn1}], params)
    prompt = turn1 + first[0].token_ids + random_ids(30, seed=7)
    with LLM(tiny_model_dir) as llm:
        reference = llm.generate([{"prompt_token_ids": prompt}], params)

    pair = Pair(tiny_model_dir, tmp_path / "kv", is_layerwise=True)
    remote = _TimingOutRemote(pair.remote, failing_layer=2)
    num_hit = pair.num_stored_blocks(prompt)
    num_pe = SPLITS[side](num_hit)
    assignment = Assignment(
        0, tuple(prompt), sampling_params_to_dict(params), num_pe, num_hit - num_pe, 0, 1
    )
    pair.decode.add(assignment)
    pair.prefill.add(assignment)
    batch = []
    while not batch:
        for ready in pair.decode.poll_ready():
            pair.prefill.on_decode_ready(ready)
        batch = pair.prefill.next_batch(lambda de: remote)
    assert pair.prefill.buffer.num_used_bytes + pair.decode.buffer.num_used_bytes > 0
    outcome = pair.prefill.run_batch(batch)
    assert not outcome.done
    ((request_id, error),) = outcome.failed
    assert request_id == 0 and isinstance(error, TransferTimeout) and "layer 2" in str(error)
    # The PE freed its side at once; the DE frees its side when the failure reaches it.
    assert pair.prefill.buffer.num_used_bytes == 0 and not pair.prefill.requests
    pair.decode.cancel(0)
    assert pair.decode.buffer.num_used_bytes == 0 and not pair.decode.requests
    # Both engines are healthy afterwards: the same prompt again gives the right tokens.
    pair.remote = remote  # has failed once; passes everything through now
    pair.next_id = 1
    (again,) = pair.generate([prompt], params, SPLITS[side])
    assert again["cached"] == num_hit * BLOCK
    assert_same_tokens(reference[0], _Out(again["token_ids"]), label=f"retry, {side} path")


def test_read_q_counts_the_reads_of_requests_waiting_for_buffer_slots(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Buffers with room for one request: the second waits for slots, and its PE-side reads
    # are still queued on the PE's node (SPEC §6's read_q), not absent from it.
    loaded = load_model(tiny_model_dir)
    identity = kv_identity(loaded.config, loaded.weights_digest, "float32", BLOCK)
    layout = identity.layout
    store = FileKVStore(tmp_path / "kv", layout, identity.fingerprint)
    prompts = [random_ids(3 * BLOCK + 5, seed=s) for s in (1, 2)]
    for prompt in prompts:
        for key in block_keys(prompt[: 3 * BLOCK], BLOCK, identity.fingerprint):
            store.write(key, bytes(layout.full_block_bytes))
    params = sampling_params_to_dict(SamplingParams(max_tokens=2))
    # Request i: 3 hit blocks, 1 read on the PE side and 2 on the DE side.
    assignments = [Assignment(i, tuple(p), params, 1, 2, 0, 1) for i, p in enumerate(prompts)]
    prefill = PrefillEngine(
        loaded.model,
        identity,
        store,
        KVBuffer(layout, 1 * layout.full_block_bytes),
        dtype=loaded.dtype,
        device=loaded.device,
        is_layerwise=True,
    )
    engine = LLMEngine(loaded, EngineConfig(), KVStoreConfig(root_dir=tmp_path / "kv"))
    decode = DecodeEngine(engine, KVBuffer(layout, 4 * layout.full_block_bytes))
    try:
        for assignment in assignments:
            prefill.add(assignment)
            decode.add(assignment)
        prefill.requests[0].reads.result()
        decode.requests[0].reads.result()
        assert prefill.num_queued_read_tokens == 1 * BLOCK  # request 1's PE-side block
        # The DE buffer holds whole prompts whichever side reads them: waiting for it is not
        # a queue on this node's SNIC.
        assert decode.num_queued_read_tokens == 0
    finally:
        prefill.close()
        decode.close()
        engine.close()
