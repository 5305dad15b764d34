"""Byte math of Layer Blocks and Full Blocks (SPEC §3), as zero-copy numpy views.

A Layer Block is the KV of ``block_size_tokens`` tokens for one layer; a Full Block is all
layers of those tokens, i.e. the Layer Blocks concatenated, so no re-layout is ever needed::

    full block  [num_layers, block_size_tokens, bytes_per_token_per_layer]   (uint8)
                 |<- layer 0 ->|<- layer 1 ->| ... |<- layer L-1 ->|
                 each slice is one layer block [block_size_tokens, bytes_per_token_per_layer]

Storage reads and writes move Full Blocks; per-layer movement into and out of GPU memory moves
Layer Blocks. Everything here is plain bytes (``uint8``): the KV dtype only shows up in
``bytes_per_token_per_layer``. No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Anything that exposes its bytes through the buffer protocol.
BlockBuffer = bytes | bytearray | memoryview | np.ndarray


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one Full Block in bytes; the same for every block of one model fingerprint."""

    num_layers: int
    block_size_tokens: int
    # K and V of one token in one layer, all heads, in the KV dtype (e.g. 2 * 8 * 128 * 2 for
    # fp16 with 8 KV heads of dim 128).
    bytes_per_token_per_layer: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size_tokens", "bytes_per_token_per_layer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be an int > 0, got {value!r}")

    @property
    def layer_block_bytes(self) -> int:
        return self.block_size_tokens * self.bytes_per_token_per_layer

    @property
    def full_block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    @property
    def layer_block_shape(self) -> tuple[int, int]:
        return (self.block_size_tokens, self.bytes_per_token_per_layer)

    @property
    def full_block_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.block_size_tokens, self.bytes_per_token_per_layer)

    def empty_full_block(self) -> np.ndarray:
        """A new zero-filled ``uint8`` Full Block."""
        return np.zeros(self.full_block_shape, dtype=np.uint8)

    def as_full_block(self, buf: BlockBuffer) -> np.ndarray:
        """View ``buf`` as a ``uint8`` Full Block ``[L, bs, bpt]`` without copying.

        ``bytes`` give a read-only view. An ndarray of any dtype is reinterpreted as bytes; it
        must be C-contiguous (a strided array cannot be viewed without a copy). Raises
        ``ValueError`` when the size is not ``full_block_bytes``.
        """
        flat = _as_flat_bytes(buf, what="full block")
        if flat.size != self.full_block_bytes:
            raise ValueError(
                f"full block must be {self.full_block_bytes} bytes for {self}, got {flat.size}"
            )
        return flat.reshape(self.full_block_shape)

    def layer_block(self, full_block: np.ndarray, layer: int) -> np.ndarray:
        """Layer ``layer`` of ``full_block`` as a view ``[bs, bpt]``; writes go through."""
        if full_block.shape != self.full_block_shape or full_block.dtype != np.uint8:
            raise ValueError(
                f"expected a uint8 full block of shape {self.full_block_shape}, "
                f"got {full_block.dtype} {full_block.shape}"
            )
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return full_block[layer]

    def concat_layer_blocks(self, layer_blocks: Sequence[BlockBuffer]) -> np.ndarray:
        """Copy exactly ``num_layers`` Layer Blocks, layer 0 first, into one new Full Block.

        Each Layer Block may be any C-contiguous buffer of ``layer_block_bytes`` bytes (shape
        ``[bs, bpt]``, ``[1, bs, bpt]`` or flat, any dtype).
        """
        if len(layer_blocks) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layer blocks, got {len(layer_blocks)}")
        full_block = np.empty(self.full_block_shape, dtype=np.uint8)
        for layer, layer_block in enumerate(layer_blocks):
            flat = _as_flat_bytes(layer_block, what=f"layer block {layer}")
            if flat.size != self.layer_block_bytes:
                raise ValueError(
                    f"layer block {layer} must be {self.layer_block_bytes} bytes, got {flat.size}"
                )
            full_block[layer] = flat.reshape(self.layer_block_shape)
        return full_block


def _as_flat_bytes(buf: BlockBuffer, *, what: str) -> np.ndarray:
    """A flat ``uint8`` view of ``buf``'s bytes, never a copy."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous to be viewed without a copy")
        return buf.reshape(-1).view(np.uint8)
    if isinstance(buf, bytes | bytearray | memoryview):
        try:
            return np.frombuffer(buf, dtype=np.uint8)
        except BufferError as exc:
            raise ValueError(f"{what} must be C-contiguous to be viewed without a copy") from exc
    raise ValueError(f"{what} must be bytes, bytearray, memoryview or ndarray, got {type(buf)}")
