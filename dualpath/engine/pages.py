"""An engine's KV pages as the store's Layer Blocks: the one part of the KV path that differs
per engine (SPEC §9).

The courier (``courier.py``) moves KV between the store, host buffers, a peer's buffer and an
engine's pages. Of the pages it asks only this: a token range of some blocks of one layer, in
and out, as Layer Blocks in the store's byte order (``KVLayout.layer_block_shape``, uint8,
host memory). Each engine's page layout is one adapter of ``KVPages``:

    PagedKVCache     our engine's cache (``kv_cache.py``): a block's layers are one tensor
    BatchPages       our PE's pages of one batch: the layers in flight, hit and new blocks
    dualpath.vllm.layouts   vLLM's pages, per attention backend (CPU, MLA, GPU layouts)

A Layer Block's byte order is the adapter's (for vLLM, the page's own order, so whole blocks
move as plain copies); the store fingerprint names it, so two orders never share a block.

On a GPU the writes into pages may run on a side stream: ``fence(layer)`` makes a layer's
writes visible to the engine's compute before it reads them. Reads are synchronous: ``out``
is filled when ``read_layer`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from dualpath.kv.layout import KVLayout


class KVPages(Protocol):
    """An engine's pages, one layer of some blocks at a time."""

    layout: KVLayout

    def write_layer(
        self,
        layer: int,
        block_ids: Sequence[int],
        blocks: np.ndarray,
        first: int = 0,
        num: int | None = None,
    ) -> None:
        """Layer Blocks ``blocks[i]`` (``[n, *layer_block_shape]`` uint8, host) into block
        ``block_ids[i]`` of ``layer``. With ``first``/``num``: only tokens ``first .. first +
        num`` of each; the page's other tokens are kept. Complete after ``fence(layer)``."""
        ...

    def read_layer(self, layer: int, block_ids: Sequence[int], out: np.ndarray) -> None:
        """Blocks ``block_ids`` of ``layer`` as Layer Blocks into ``out`` (``[n,
        *layer_block_shape]`` uint8, host); filled on return."""
        ...

    def layer_view(self, layer: int, block_ids: Sequence[int]) -> np.ndarray | None:
        """A writable zero-copy host view ``[n, *layer_block_shape]`` of blocks ``block_ids``
        of ``layer`` in the store's byte order, or None when there is none (device memory, a
        page order other than the store's, blocks not adjacent): then the caller copies."""
        ...

    def fence(self, layer: int) -> None:
        """Make every write to ``layer`` so far visible to the engine's compute."""
        ...


class LayerBlockPages:
    """The store's Full Block operations (``kv_io.BlockCache``) of any ``KVPages``, one Layer
    Block at a time: a vLLM block's layers are separate tensors, so a Full Block is no single
    view and the store reads and writes through host copies."""

    layout: KVLayout
    write_layer: Callable[..., None]  # ``KVPages``' own, from the adapter
    read_layer: Callable[[int, Sequence[int], np.ndarray], None]

    def fence(self, layer: int) -> None:
        pass

    def host_view(self, block_id: int) -> np.ndarray | None:
        return None

    def load_full_block(self, block_id: int, full_block: np.ndarray) -> None:
        for layer in range(self.layout.num_layers):
            self.write_layer(layer, (block_id,), full_block[layer : layer + 1])
            self.fence(layer)

    def copy_full_block(self, block_id: int) -> np.ndarray:
        full_block = self.layout.empty_full_block()
        for layer in range(self.layout.num_layers):
            self.read_layer(layer, (block_id,), full_block[layer : layer + 1])
        return full_block


def adjacent(block_ids: Sequence[int]) -> bool:
    """Whether ``block_ids`` are consecutive and increasing (one contiguous run of pages)."""
    return len(block_ids) < 2 or all(
        b == a + 1 for a, b in zip(block_ids, block_ids[1:], strict=False)
    )


class PageCopier(Protocol):
    """How bytes reach pages on the pages' device: the only place that knows about streams."""

    def write(self, layer: int, blocks: np.ndarray, put: Callable[[torch.Tensor], None]) -> None:
        """``put(blocks on the pages' device)``; complete after ``fence(layer)``. ``blocks``
        may be reused by the caller on return."""
        ...

    def read(self, layer: int, take: Callable[[], torch.Tensor], out: np.ndarray) -> None:
        """``take()`` (after every write to ``layer``) into ``out``; filled on return."""
        ...

    def fence(self, layer: int) -> None:
        """Make the caller's stream wait for every write to ``layer`` so far."""
        ...


class HostCopier:
    """``CudaCopier``'s CPU twin: the same calls, done at once on the caller's thread."""

    def write(self, layer: int, blocks: np.ndarray, put: Callable[[torch.Tensor], None]) -> None:
        put(torch.from_numpy(np.ascontiguousarray(blocks)))

    def read(self, layer: int, take: Callable[[], torch.Tensor], out: np.ndarray) -> None:
        taken = take()
        torch.from_numpy(out).view(taken.shape).copy_(taken)

    def fence(self, layer: int) -> None:
        """Writes are done on return: nothing to wait for."""


class CudaCopier:
    """Writes into a GPU's pages on a side stream, so that layer l + 1 loads while layer l
    computes: each write stages through page-locked memory, runs on the side stream and
    records layer ``layer``'s event; ``fence(layer)`` makes the caller's (compute) stream wait
    on that event only. Built where the compute stream is current (``register_kv_caches``)."""

    def __init__(self, device: torch.device, num_layers: int) -> None:
        self.device = device
        self.compute_stream = torch.cuda.current_stream(device)
        self.side_stream = torch.cuda.Stream(device)
        self.layer_events = [torch.cuda.Event() for _ in range(num_layers)]

    def write(self, layer: int, blocks: np.ndarray, put: Callable[[torch.Tensor], None]) -> None:
        # Page-locked, so the device copy is one DMA; torch's host allocator keeps the buffer
        # until that copy is done, so the caller's array is free on return.
        staging = torch.empty(blocks.shape, dtype=torch.uint8, pin_memory=True)
        staging.numpy()[...] = blocks
        with torch.cuda.stream(self.side_stream):
            # After the compute queued so far: it may still read a block given out again.
            self.side_stream.wait_stream(self.compute_stream)
            put(staging.to(self.device, non_blocking=True))
            self.layer_events[layer].record(self.side_stream)

    def read(self, layer: int, take: Callable[[], torch.Tensor], out: np.ndarray) -> None:
        self.fence(layer)
        taken = take()
        torch.from_numpy(out).view(taken.shape).copy_(taken)  # to pageable memory: synchronous

    def fence(self, layer: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.layer_events[layer])


class BatchPages:
    """Our PE's pages for one batch: block j of a request at page ``first_page + j``, for the
    layers in flight only (two when layer-wise: the one computing and the one loading; every
    layer otherwise), as the layer-wise prefill of SPEC §3 keeps them. Hit blocks load into
    them, each layer's new entries are written into them, and what the DE lacks is sent from
    them. Zeroed once, so a prompt's partial last block is sent with zeros past its tokens."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        *,
        num_resident_layers: int,
        dtype: torch.dtype,
        entry_shape: tuple[int, ...],
        device: torch.device,
        copier: PageCopier,
    ) -> None:
        """``copier``: the engine's (``CudaCopier`` on a GPU: loads on a side stream)."""
        self.layout = layout
        self.copier = copier
        self.num_resident_layers = num_resident_layers
        self.dtype = dtype
        self.entry_shape = entry_shape
        shape = (num_resident_layers, num_blocks, *layout.layer_block_shape)
        with torch.inference_mode(False):  # the loader thread writes it outside the forward's
            self.pages = torch.zeros(shape, dtype=torch.uint8, device=device)
        self._host = self.pages.numpy() if device.type == "cpu" else None

    def _resident(self, layer: int) -> int:
        return layer % self.num_resident_layers

    def write_layer(self, layer, block_ids, blocks, first=0, num=None) -> None:  # noqa: ANN001
        end = self.layout.block_size_tokens if num is None else first + num
        pages = self.pages[self._resident(layer)]

        def put(source: torch.Tensor) -> None:
            for i, block_id in enumerate(block_ids):
                pages[block_id, first:end] = source[i, first:end]

        self.copier.write(layer, blocks, put)

    def read_layer(self, layer: int, block_ids: Sequence[int], out: np.ndarray) -> None:
        index = torch.as_tensor(list(block_ids), device=self.pages.device)
        self.copier.read(layer, lambda: self.pages[self._resident(layer)][index], out)

    def layer_view(self, layer: int, block_ids: Sequence[int]) -> np.ndarray | None:
        if self._host is None or not block_ids or not adjacent(block_ids):
            return None
        return self._host[self._resident(layer), block_ids[0] : block_ids[-1] + 1]

    def fence(self, layer: int) -> None:
        self.copier.fence(layer)

    def entries(self, layer: int, first_page: int, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` entries from page ``first_page`` on of ``layer``
        (``[num_tokens, *entry_shape]``, a view: the attention's past)."""
        if num_tokens == 0:  # nothing to view (an empty reshape cannot infer its rows)
            return torch.empty((0, *self.entry_shape), dtype=self.dtype, device=self.pages.device)
        num_pages = -(-num_tokens // self.layout.block_size_tokens)
        pages = self.pages[self._resident(layer), first_page : first_page + num_pages]
        return pages.view(self.dtype).reshape(-1, *self.entry_shape)[:num_tokens]

    def put_entries(self, layer: int, first_page: int, entries: torch.Tensor) -> None:
        """New tokens' entries (``[n, *entry_shape]``) from page ``first_page`` on."""
        self.entries(layer, first_page, entries.shape[0]).copy_(entries)
