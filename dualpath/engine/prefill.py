"""The prefill engine (PE): loads a request's hit KV, prefills its misses layer by layer, and
leaves the complete prompt KV in its decode engine's buffer (SPEC §2–§3).

For a batch, layer by layer::

    hit KV of layer l  <- PE buffer (PE-side blocks, read from storage through the PE node's
                          SNIC before the batch) and the DE buffer (DE-side blocks, read by
                          the DE through its node's SNIC, pulled here over the CNIC)
    compute layer l    on the new tokens, attending over hit + new
    KV of layer l      -> DE buffer: the PE-side hit blocks and the miss tokens' blocks
                          (the DE-side hit blocks are already there)

With layer-wise prefill only one layer of hit KV is resident per batch and layer l+1's hit KV
is fetched while layer l computes. Without it (the ``basic`` and ``layerwise``-less modes),
every layer's hit KV is loaded before the forward and held until it ends.

Batches come from the compute-quota ``PrefillBatcher`` (SPEC §6): ready requests queue in FIFO
order and each batch is packed up to the predicted time of one layer; the request that would
overflow is cut at a block boundary and its remainder runs in a later batch (chunked prefill).
A chunk attends over the hit KV (loaded again, layer by layer) and over the KV its earlier
chunks computed, which the PE keeps on its device until the request's last chunk; each chunk's
new blocks go to the DE buffer as they are computed, so the DE still receives every block once.

The DE buffer is reached through a ``RemoteBuffer`` (a transport in a cluster; the tests pass
one that copies within the process), so this module does no networking of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import numpy as np
import torch

from dualpath.engine.buffers import KVBuffer, SlotQueue, StoreReader
from dualpath.engine.sampling import (
    banned_token_ids,
    make_generator,
    sample,
    token_finish_reason,
)
from dualpath.kv.hashing import BlockKey, block_keys
from dualpath.kv.store import KVStore
from dualpath.model.identity import KVIdentity
from dualpath.model.layerwise import LayerwiseModel, PackedBatch
from dualpath.protocol import Assignment, DecodeReady, PrefillDone
from dualpath.scheduler.attention_predictor import ConstantAttentionTimePredictor
from dualpath.scheduler.batching import PrefillBatcher, PrefillChunk, PrefillWork
from dualpath.transfer.traffic import Mover, direct_move
from dualpath.types import SamplingParams, sampling_params_from_dict

logger = logging.getLogger(__name__)


class RemoteBuffer(Protocol):
    """The PE's access to one DE's KV buffer; slots and layers as in ``KVBuffer``."""

    def read_layer(self, slots: Sequence[int], layer: int, out: np.ndarray) -> None:
        """Copy Layer Blocks ``(slot, layer)`` for ``slots`` into ``out[i]`` (blocking)."""
        ...

    def write_layer(self, slots: Sequence[int], layer: int, data: np.ndarray) -> None:
        """Post ``data[i]`` to ``(slots[i], layer)``; may return before the bytes land."""
        ...

    def flush(self) -> None:
        """Block until every posted write has landed."""
        ...


@dataclass(eq=False)
class PrefillRequest:
    assignment: Assignment
    params: SamplingParams
    keys: list[BlockKey]
    pe_slots: list[int] = field(default_factory=list)
    reads: Future[int] | None = None  # -> leading PE-side blocks read
    decode_ready: DecodeReady | None = None
    # Set when the request joins the batcher: leading blocks whose KV was read (either side).
    num_hit: int | None = None
    # Per layer, the entries of the tokens earlier chunks computed (device); empty until a chunk
    # that is not the last one has run.
    computed: list[torch.Tensor] = field(default_factory=list)

    @property
    def request_id(self) -> int:
        return self.assignment.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.assignment.prompt_token_ids)

    @property
    def is_ready(self) -> bool:
        return self.reads is not None and self.reads.done() and self.decode_ready is not None

    def num_hit_blocks(self) -> int:
        """Leading blocks whose KV is usable: PE-side ones read, then DE-side ones read, as
        long as no block before them failed."""
        assert self.reads is not None and self.decode_ready is not None, "request not ready"
        num_pe_read = self.reads.result()
        if num_pe_read < self.assignment.num_prefill_side_blocks:
            return num_pe_read
        return num_pe_read + self.decode_ready.num_decode_side_blocks_read


class PrefillEngine:
    def __init__(
        self,
        model: LayerwiseModel,
        identity: KVIdentity,
        store: KVStore | None,
        buffer: KVBuffer,
        *,
        dtype: torch.dtype,
        device: torch.device,
        is_layerwise: bool = True,
        mover: Mover = direct_move,
        num_io_threads: int = 4,
        batcher: PrefillBatcher | None = None,
        on_read_done: Callable[[], None] | None = None,
    ) -> None:
        """``batcher`` packs the batches (``None``: no quota, every ready request at once);
        ``on_read_done`` is called from a reading thread when a request's PE-side reads end."""
        self.model = model
        self.identity = identity
        self.layout = identity.layout
        self.block_size = identity.layout.block_size_tokens
        self.store = store
        self.buffer = buffer
        self.dtype = dtype
        self.device = device
        self.is_layerwise = is_layerwise
        self.mover = mover
        self.reader = StoreReader(
            store, buffer, mover, num_threads=num_io_threads, name="pe-read", on_done=on_read_done
        )
        # Loads the next layer's hit KV while the current layer computes.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="pe-layer-load")
        self.requests: dict[int, PrefillRequest] = {}
        # Requests waiting for PE buffer slots (back-pressure), then reading.
        self._slot_queue: SlotQueue[PrefillRequest] = SlotQueue(buffer)
        self.batcher = batcher or PrefillBatcher(
            ConstantAttentionTimePredictor(0.0),
            quota_s=float("inf"),
            min_chunk_tokens=self.block_size,
            chunk_align_tokens=self.block_size,
        )
        self._entry_shape = model.cache_entry_shape
        self._eos_token_ids = model.config.eos_token_ids

    # --- requests ---------------------------------------------------------------------------

    def add(self, assignment: Assignment) -> None:
        """Accept a placed request and start reading its PE-side hit blocks."""
        num_pe_blocks = assignment.num_prefill_side_blocks
        self.buffer.check_fits(num_pe_blocks)
        prompt = list(assignment.prompt_token_ids)
        request = PrefillRequest(
            assignment,
            sampling_params_from_dict(assignment.sampling),
            block_keys(
                prompt[: assignment.num_hit_blocks * self.block_size],
                self.block_size,
                self.identity.fingerprint,
            ),
        )
        self.requests[request.request_id] = request
        self._slot_queue.add(request, num_pe_blocks, partial(self._start_reads, request))

    def _start_reads(self, request: PrefillRequest, slots: list[int]) -> None:
        request.pe_slots = slots
        request.reads = self.reader.submit(
            request.keys[: len(slots)], slots, f"request {request.request_id} PE side"
        )

    def on_decode_ready(self, msg: DecodeReady) -> None:
        request = self.requests.get(msg.request_id)
        if request is not None:
            request.decode_ready = msg

    def cancel(self, request_id: int) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if self._slot_queue.remove(request):
            return
        if request.reads is not None:
            request.reads.result()  # the read thread owns the slots until it returns
        self.batcher.remove(request_id)
        self._release(request)

    def _release(self, request: PrefillRequest) -> None:
        self.buffer.free(request.pe_slots)
        request.pe_slots = []
        request.computed = []
        self._slot_queue.start_waiting()

    def next_batch(
        self, can_send: Callable[[PrefillRequest], bool] = lambda request: True
    ) -> list[tuple[PrefillRequest, PrefillChunk]]:
        """Queue newly ready requests (those ``can_send`` allows: their DE is reachable) for
        the batcher, in order, and take its next batch: ``(request, chunk)`` pairs."""
        for request in self.requests.values():
            if request.num_hit is None and request.is_ready and can_send(request):
                request.num_hit = request.num_hit_blocks()
                num_cached = request.num_hit * self.block_size
                self.batcher.add(
                    PrefillWork(
                        request.request_id, num_cached, request.num_prompt_tokens - num_cached
                    )
                )
        return [(self.requests[c.request_id], c) for c in self.batcher.next_batch().chunks]

    @property
    def num_queued_read_tokens(self) -> int:
        """Tokens queued for storage reads on this engine (its share of its node's read_q):
        reads submitted and not done, and the PE-side blocks of requests still waiting for
        buffer slots (left out, a node whose buffer is full would look idle to the scheduler
        and draw the next reads)."""
        num_waiting = self._slot_queue.num_waiting_slots  # one slot per PE-side block
        return (self.reader.num_queued_blocks + num_waiting) * self.block_size

    @property
    def num_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests.values())

    # --- the batch --------------------------------------------------------------------------

    @torch.inference_mode()
    def run_batch(
        self,
        batch: list[tuple[PrefillRequest, PrefillChunk]],
        remote_of: Callable[[int], RemoteBuffer],
        between_layers: Callable[[], None] | None = None,
    ) -> list[PrefillDone]:
        """Compute ``batch``'s chunks and leave their KV in each request's DE buffer; one
        ``PrefillDone`` per request whose last chunk this was (its prompt KV is complete).

        ``between_layers`` is called after each layer but the last: the engine's chance to
        take new requests (``add`` starts their PE-side reads, which then overlap this batch's
        compute) and to report its load. It must not cancel a request of this batch.

        Any exception mid-batch (a ``DualPathError``: a transfer timed out, a DE died; or a
        bug) cancels every request of the batch -- their PE buffer slots and chunk KV are
        freed -- and is re-raised; the caller fails them, which makes their DEs free theirs.
        """
        try:
            return self._run_batch(batch, remote_of, between_layers)
        except Exception:
            for request, _ in batch:
                self.cancel(request.request_id)
            raise

    def _run_batch(
        self,
        batch: list[tuple[PrefillRequest, PrefillChunk]],
        remote_of: Callable[[int], RemoteBuffer],
        between_layers: Callable[[], None] | None,
    ) -> list[PrefillDone]:
        requests = [request for request, _ in batch]
        chunks = [chunk for _, chunk in batch]
        packed = PackedBatch(
            num_cached_tokens=tuple(c.num_cached_tokens for c in chunks),
            num_new_tokens=tuple(c.num_new_tokens for c in chunks),
        )
        input_ids = torch.tensor(
            [
                t
                for r, c in batch
                for t in r.assignment.prompt_token_ids[
                    c.num_cached_tokens : c.num_cached_tokens + c.num_new_tokens
                ]
            ],
            device=self.device,
        )
        remotes = [remote_of(r.assignment.decode_engine_id) for r in requests]
        offsets = packed.row_offsets
        num_layers = self.model.num_layers
        past_of, loading = self._past_source(batch, remotes)

        def on_layer(layer: int, new: torch.Tensor) -> None:
            for i, (request, chunk) in enumerate(batch):
                rows = slice(offsets[i], offsets[i + 1])
                self._send_layer(request, chunk, remotes[i], layer, new[rows])
                if not chunk.is_last_chunk:
                    self._keep_chunk(request, layer, new[rows])
            if between_layers is not None and layer + 1 < num_layers:
                between_layers()

        try:
            hidden = self.model.forward_layers(input_ids, packed, past_of, on_layer)
        finally:
            if loading:  # a failed layer: the loader reads the buffers until done
                wait(loading)
        for remote in {id(r): r for r in remotes}.values():
            remote.flush()
        last = [i for i, chunk in enumerate(chunks) if chunk.is_last_chunk]
        if not last:
            return []
        last_rows = torch.tensor([offsets[i + 1] - 1 for i in last], device=self.device)
        logits = self.model.logits(hidden[last_rows]).cpu()
        done = []
        for row, i in enumerate(last):
            request = requests[i]
            params = request.params
            # min_tokens holds for the first token too: no end-of-sequence or stop token yet.
            # A request going on after a lost DE samples its next output token, not its first.
            num_output_tokens = request.assignment.num_output_tokens
            banned = banned_token_ids(params, num_output_tokens, self._eos_token_ids)
            generator = make_generator(params, num_output_tokens)
            token_id, logprob = sample(logits[row], params, generator, banned)
            assert request.num_hit is not None, "a batched request has joined the batcher"
            finish_reason = token_finish_reason(
                params, token_id, num_output_tokens, self._eos_token_ids
            )
            done.append(
                PrefillDone(
                    request.request_id,
                    token_id,
                    None if logprob is None else (logprob.logprob, logprob.top),
                    request.num_hit * self.block_size,
                    finish_reason,
                )
            )
            del self.requests[request.request_id]
            self._release(request)
        return done

    def _past_source(
        self, batch: list[tuple[PrefillRequest, PrefillChunk]], remotes: list[RemoteBuffer]
    ) -> tuple[Callable[[int], list[torch.Tensor]], list[Future]]:
        """Each layer's past entries for ``forward_layers``, and the load in flight (if any).

        Layer-wise, layer l+1's hit KV loads (PE buffer, DE buffer over the CNIC, host ->
        device) while layer l computes: at most two layers of hit KV are resident. Otherwise
        (``basic``) every layer's is loaded before the first computes."""
        if not self.is_layerwise:
            preloaded = [self._past_kv(batch, remotes, i) for i in range(self.model.num_layers)]
            return preloaded.__getitem__, []
        loading = [self._loader.submit(self._past_kv, batch, remotes, 0)]

        def past_of(layer: int) -> list[torch.Tensor]:
            past = loading.pop().result()
            if layer + 1 < self.model.num_layers:
                loading.append(self._loader.submit(self._past_kv, batch, remotes, layer + 1))
            return past

        return past_of, loading

    def _keep_chunk(self, request: PrefillRequest, layer: int, new: torch.Tensor) -> None:
        """Append a chunk's layer entries to what the request's later chunks attend over."""
        if len(request.computed) == layer:
            request.computed.append(new.clone())
        else:
            request.computed[layer] = torch.cat((request.computed[layer], new))

    def _past_kv(
        self,
        batch: list[tuple[PrefillRequest, PrefillChunk]],
        remotes: list[RemoteBuffer],
        layer: int,
    ) -> list[torch.Tensor]:
        """Layer ``layer``'s entries before each request's chunk: its hit KV, then what its
        earlier chunks computed."""
        requests = [request for request, _ in batch]
        past = self._hit_kv(requests, remotes, layer)
        for i, (request, chunk) in enumerate(batch):
            assert request.num_hit is not None, "a batched request has joined the batcher"
            if chunk.num_cached_tokens > request.num_hit * self.block_size:
                past[i] = torch.cat((past[i], request.computed[layer]))
        return past

    def _hit_kv(
        self, requests: list[PrefillRequest], remotes: list[RemoteBuffer], layer: int
    ) -> list[torch.Tensor]:
        """Layer ``layer``'s hit entries of each request, on the device."""
        past = []
        for request, remote in zip(requests, remotes, strict=True):
            num_hit = request.num_hit
            assert num_hit is not None, "a batched request has joined the batcher"
            layer_blocks = self._host_layer_blocks(num_hit)
            num_pe = min(num_hit, request.assignment.num_prefill_side_blocks)
            for i in range(num_pe):
                layer_blocks[i] = self.buffer.layer_block(request.pe_slots[i], layer)
            if num_hit > num_pe:
                assert request.decode_ready is not None, "ready request"
                de_slots = request.decode_ready.slots[num_pe:num_hit]
                into = layer_blocks[num_pe:]
                self.mover("cnic", into.nbytes, partial(remote.read_layer, de_slots, layer, into))
            past.append(self._to_device(layer_blocks))
        return past

    def _host_layer_blocks(self, num_blocks: int) -> np.ndarray:
        """Host staging for Layer Blocks on their way to the device: page-locked with a GPU
        (an asynchronous DMA; torch's caching host allocator recycles it once the copy ends)."""
        shape = (num_blocks, *self.layout.layer_block_shape)
        if self.device.type == "cuda":
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(shape, dtype=np.uint8)

    def _to_device(self, layer_blocks: np.ndarray) -> torch.Tensor:
        num_tokens = layer_blocks.shape[0] * self.block_size
        if num_tokens == 0:  # an empty array has stride 0, which a dtype view refuses
            return torch.empty((0, *self._entry_shape), dtype=self.dtype, device=self.device)
        host = torch.from_numpy(layer_blocks).view(self.dtype).view(num_tokens, *self._entry_shape)
        if self.device.type == "cpu":
            return host
        return self.mover(
            "cnic", layer_blocks.nbytes, lambda: host.to(self.device, non_blocking=True)
        )

    def _send_layer(
        self,
        request: PrefillRequest,
        chunk: PrefillChunk,
        remote: RemoteBuffer,
        layer: int,
        new: torch.Tensor,
    ) -> None:
        """Layer ``layer`` of what the DE lacks: the PE-side hit blocks (with the first chunk)
        and the chunk's new tokens, whose first block is fresh (chunks are block-aligned)."""
        assert request.decode_ready is not None and request.num_hit is not None, "ready request"
        slots = request.decode_ready.slots
        bs = self.block_size
        num_hit = request.num_hit
        is_first_chunk = chunk.num_cached_tokens == num_hit * bs
        assert chunk.num_cached_tokens % bs == 0, "chunks start on a block boundary"
        num_pe = min(num_hit, request.assignment.num_prefill_side_blocks)
        if num_pe and is_first_chunk:
            pe_blocks = np.stack(
                [self.buffer.layer_block(s, layer) for s in request.pe_slots[:num_pe]]
            )
            self.mover(
                "cnic",
                pe_blocks.nbytes,
                lambda: remote.write_layer(slots[:num_pe], layer, pe_blocks),
            )
        num_new = new.shape[0]
        num_new_blocks = -(-num_new // bs)
        entries = torch.zeros((num_new_blocks * bs, *self._entry_shape), dtype=self.dtype)
        entries[:num_new] = new.to("cpu")
        new_blocks = (
            entries.view(torch.uint8)
            .numpy()
            .reshape(num_new_blocks, *self.layout.layer_block_shape)
        )
        first = chunk.num_cached_tokens // bs
        self.mover(
            "cnic",
            new_blocks.nbytes,
            lambda: remote.write_layer(slots[first : first + num_new_blocks], layer, new_blocks),
        )

    @property
    def num_read_bytes(self) -> int:
        return self.reader.num_read_bytes

    def close(self) -> None:
        self.reader.close()
        self._loader.shutdown()
