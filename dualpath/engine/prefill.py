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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dualpath.engine.buffers import BufferedRequest, BufferReads, KVBuffer
from dualpath.engine.courier import (
    KVCourier,
    KVTransfer,
    RemoteBuffer,
    StepTransfer,
    plan_prefill,
)
from dualpath.engine.pages import BatchPages, CudaCopier, HostCopier, PageCopier
from dualpath.engine.sampling import (
    banned_token_ids,
    make_generator,
    sample,
    token_finish_reason,
)
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import KVStore
from dualpath.model.identity import KVIdentity
from dualpath.model.layerwise import LayerwiseModel, PackedBatch
from dualpath.protocol import Assignment, DecodeReady, PrefillDone
from dualpath.scheduler.attention_predictor import ConstantAttentionTimePredictor
from dualpath.scheduler.batching import PrefillBatcher, PrefillChunk, PrefillWork
from dualpath.transfer.traffic import Mover, direct_move
from dualpath.types import sampling_params_from_dict

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """A batch's ends: ``done`` for each request whose last chunk ran; ``failed`` (request id,
    error) for each one a transfer error touched (its DE died or timed out), already
    cancelled here; the batch's other requests went on."""

    done: list[PrefillDone]
    failed: list[tuple[int, Exception]]


@dataclass(eq=False)
class PrefillRequest(BufferedRequest):
    """``keys``/``slots``/``reads``: its PE-side hit blocks, read into this engine's buffer."""

    decode_ready: DecodeReady | None = None
    # Set when the request joins the batcher: leading blocks whose KV was read (either side),
    # and its KV movement (loads, sends to its DE).
    num_hit: int | None = None
    transfer: KVTransfer | None = None
    # Per layer, the entries of the tokens earlier chunks computed (device); empty until a chunk
    # that is not the last one has run.
    computed: list[torch.Tensor] = field(default_factory=list)

    @property
    def is_ready(self) -> bool:
        return self.is_read and self.decode_ready is not None


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
        self.store_reads: BufferReads[PrefillRequest] = BufferReads(
            "PE", store, buffer, mover, num_io_threads, on_read_done
        )
        # Loads a layer's hit KV while the one before computes; sends each layer to the DE.
        self.courier = KVCourier(
            mover,
            num_layers=model.num_layers,
            block_size=self.block_size,
            is_layerwise=is_layerwise,
            name="pe-layer-load",
        )
        self.requests: dict[int, PrefillRequest] = {}
        self.batcher = batcher or PrefillBatcher(
            ConstantAttentionTimePredictor(0.0),
            quota_s=float("inf"),
            min_chunk_tokens=self.block_size,
            chunk_align_tokens=self.block_size,
        )
        self._entry_shape = model.cache_entry_shape
        # Loads into a batch's pages: on a GPU on a side stream, one event per layer.
        self._copier: PageCopier = (
            CudaCopier(device, model.num_layers) if device.type == "cuda" else HostCopier()
        )
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
                cache_salt=assignment.cache_salt,
            ),
        )
        self.requests[request.request_id] = request
        self.store_reads.add(request, num_pe_blocks, self._start_reads)

    def _start_reads(self, request: PrefillRequest) -> None:
        self.store_reads.read(request, request.keys[: len(request.slots)], request.slots)

    def on_decode_ready(self, msg: DecodeReady) -> None:
        request = self.requests.get(msg.request_id)
        if request is not None:
            request.decode_ready = msg

    def cancel(self, request_id: int) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.batcher.remove(request_id)
        self._release(request)

    def _release(self, request: PrefillRequest) -> None:
        self.store_reads.release(request)
        request.computed = []

    def next_batch(
        self, remote_of: Callable[[int], RemoteBuffer | None]
    ) -> list[tuple[PrefillRequest, PrefillChunk]]:
        """Plan every newly ready request whose DE ``remote_of`` reaches (by engine id; None:
        not yet) and queue it for the batcher, in order; take the batcher's next batch:
        ``(request, chunk)`` pairs."""
        for request in self.requests.values():
            if request.transfer is not None or not request.is_ready:
                continue
            remote = remote_of(request.assignment.decode_engine_id)
            if remote is not None:
                self._plan(request, remote)
                num_cached = request.num_hit * self.block_size
                self.batcher.add(
                    PrefillWork(
                        request.request_id, num_cached, request.num_prompt_tokens - num_cached
                    )
                )
        return [(self.requests[c.request_id], c) for c in self.batcher.next_batch().chunks]

    def _plan(self, request: PrefillRequest, remote: RemoteBuffer) -> None:
        ready, reads = request.decode_ready, request.reads
        assert ready is not None and reads is not None, "a request not ready"
        request.transfer, request.num_hit = plan_prefill(
            request.request_id,
            buffer=self.buffer,
            pe_slots=request.slots,
            num_prefill_side_blocks=request.assignment.num_prefill_side_blocks,
            num_pe_read=reads.result(),
            remote=remote,
            de_slots=ready.slots,
            num_de_read=ready.num_decode_side_blocks_read,
            num_prompt_tokens=request.num_prompt_tokens,
            block_size=self.block_size,
        )

    @property
    def num_queued_read_tokens(self) -> int:
        """Tokens queued for storage reads on this engine (its share of its node's read_q):
        reads submitted and not done, and the PE-side blocks of requests still waiting for
        buffer slots (left out, a node whose buffer is full would look idle to the scheduler
        and draw the next reads)."""
        return self.store_reads.num_queued_blocks(waiting=True) * self.block_size

    @property
    def num_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests.values())

    # --- the batch --------------------------------------------------------------------------

    @torch.inference_mode()
    def run_batch(
        self,
        batch: list[tuple[PrefillRequest, PrefillChunk]],
        between_layers: Callable[[], None] | None = None,
    ) -> BatchOutcome:
        """Compute ``batch``'s chunks and leave their KV in each request's DE buffer.

        ``between_layers`` is called after each layer but the last: the engine's chance to
        take new requests (``add`` starts their PE-side reads, which then overlap this batch's
        compute) and to report its load. It must not cancel a request of this batch.

        A transfer error fails the requests it touches (``BatchOutcome.failed``, cancelled
        here); the others go on. Any other exception mid-batch (a bug) cancels every request
        of the batch -- their PE buffer slots and chunk KV are freed -- and is re-raised.
        """
        try:
            return self._run_batch(batch, between_layers)
        except Exception:
            for request, _ in batch:
                self.cancel(request.request_id)
            raise

    def _run_batch(
        self,
        batch: list[tuple[PrefillRequest, PrefillChunk]],
        between_layers: Callable[[], None] | None,
    ) -> BatchOutcome:
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
        pages, steps = self._batch_pages(batch)
        offsets = packed.row_offsets
        num_layers = self.model.num_layers
        bs = self.block_size

        def past_of(layer: int) -> list[torch.Tensor]:
            """Each chunk's past: its hit KV (loaded into the pages), then what its earlier
            chunks computed."""
            self.courier.wait_for_layer(layer)
            past = []
            for (request, chunk), step in zip(batch, steps, strict=True):
                assert request.num_hit is not None, "a batched request is planned"
                hit = pages.entries(layer, step.block_ids[0], request.num_hit * bs)
                if chunk.num_cached_tokens > request.num_hit * bs:
                    hit = torch.cat((hit, request.computed[layer]))
                past.append(hit)
            return past

        def on_layer(layer: int, new: torch.Tensor) -> None:
            for i, ((request, chunk), step) in enumerate(zip(batch, steps, strict=True)):
                rows = new[offsets[i] : offsets[i + 1]]
                pages.put_entries(layer, step.block_ids[chunk.num_cached_tokens // bs], rows)
                if not chunk.is_last_chunk:
                    self._keep_chunk(request, layer, rows)
            self.courier.save_layer(layer)
            if between_layers is not None and layer + 1 < num_layers:
                between_layers()

        self.courier.begin_step(steps, pages)
        try:
            hidden = self.model.forward_layers(input_ids, packed, past_of, on_layer)
        finally:
            self.courier.end_step()
        failed = []
        for transfer in self.courier.failed(steps):
            assert transfer.transfer_error is not None
            failed.append((transfer.request_id, transfer.transfer_error))
            self.cancel(transfer.request_id)
        last = [
            i
            for i, (request, chunk) in enumerate(batch)
            if chunk.is_last_chunk and request.transfer.transfer_error is None
        ]
        if not last:
            return BatchOutcome([], failed)
        last_rows = torch.tensor([offsets[i + 1] - 1 for i in last], device=self.device)
        logits = self.model.logits(hidden[last_rows]).cpu()
        done = [self._first_token(batch[i][0], logits[row]) for row, i in enumerate(last)]
        return BatchOutcome(done, failed)

    def _first_token(self, request: PrefillRequest, logits: torch.Tensor) -> PrefillDone:
        """Sample a request's first token and release it: its prompt KV is in its DE's buffer."""
        params = request.params
        # min_tokens holds for the first token too: no end-of-sequence or stop token yet.
        # A request going on after a lost DE samples its next output token, not its first.
        num_output_tokens = request.assignment.num_output_tokens
        banned = banned_token_ids(params, num_output_tokens, self._eos_token_ids)
        generator = make_generator(params, num_output_tokens)
        token_id, logprob = sample(logits, params, generator, banned)
        assert request.num_hit is not None, "a batched request is planned"
        finish_reason = token_finish_reason(
            params, token_id, num_output_tokens, self._eos_token_ids
        )
        del self.requests[request.request_id]
        self._release(request)
        return PrefillDone(
            request.request_id,
            token_id,
            None if logprob is None else (logprob.logprob, logprob.top),
            request.num_hit * self.block_size,
            finish_reason,
        )

    def _batch_pages(
        self, batch: list[tuple[PrefillRequest, PrefillChunk]]
    ) -> tuple[BatchPages, list[StepTransfer]]:
        """The batch's pages (each request's blocks up to its chunk's end, one after another)
        and each request's step: load its hit blocks (every chunk attends over them), send
        what its DE lacks up to the chunk's end."""
        bs = self.block_size
        steps = []
        num_pages = 0
        for request, chunk in batch:
            assert request.transfer is not None and request.num_hit is not None, "planned"
            assert chunk.num_cached_tokens % bs == 0, "chunks start on a block boundary"
            end = chunk.num_cached_tokens + chunk.num_new_tokens
            num_blocks = -(-end // bs)
            steps.append(
                StepTransfer(
                    request.transfer,
                    range(num_pages, num_pages + num_blocks),
                    load_num=request.num_hit * bs,
                    num_reached=end,
                )
            )
            num_pages += num_blocks
        pages = BatchPages(
            self.layout,
            num_pages,
            num_resident_layers=2 if self.is_layerwise else self.model.num_layers,
            dtype=self.dtype,
            entry_shape=self._entry_shape,
            device=self.device,
            copier=self._copier,
        )
        return pages, steps

    def _keep_chunk(self, request: PrefillRequest, layer: int, new: torch.Tensor) -> None:
        """Append a chunk's layer entries to what the request's later chunks attend over."""
        if len(request.computed) == layer:
            request.computed.append(new.clone())
        else:
            request.computed[layer] = torch.cat((request.computed[layer], new))

    def close(self) -> None:
        self.store_reads.close()
        self.courier.close()
