"""Every ``*Config`` dataclass: frozen, validated, commented, inert.

Constructing a config does no I/O, reads no environment and sets up no logging; ``cli.py``
builds configs from flags, and runners write the resolved config next to their results.
Derived values come from functions that return new objects (``dataclasses.replace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class KVStoreConfig:
    """Where and how much KV the external store keeps. ``root_dir=None`` disables the store."""

    root_dir: Path | None = None
    # None = unbounded. The store evicts least-recently-used Full Blocks beyond this budget.
    capacity_bytes: int | None = None
    # Verify every block's checksum on read; a damaged block is dropped and recomputed.
    verify_checksums: bool = True
    # fsync each block before its rename: survives power loss, costs write latency.
    fsync_writes: bool = False

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0 or None, got {self.capacity_bytes}")

    @property
    def is_enabled(self) -> bool:
        return self.root_dir is not None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine's memory and batching limits, and where it runs."""

    # Tokens per paged KV block, which is also the store's Full Block (SPEC §3); 64 is the
    # paper's write-back example and small enough that a turn's append fills a few blocks.
    block_size_tokens: int = 64
    device: str = "cpu"
    # Weights and KV dtype. float32 is the default because exactness tests need it on CPU.
    dtype: str = "float32"
    # Device KV memory in blocks; None = as many as fit in kv_cache_bytes.
    num_device_blocks: int | None = None
    # Budget for the paged KV cache when num_device_blocks is None. 1 GiB holds ~8K blocks of
    # the tiny model (512K tokens): plenty on a CPU, small on a GPU.
    kv_cache_bytes: int = 1 << 30
    # Threads reading hit blocks from the store in parallel (a store is many files or a DFS).
    num_io_threads: int = 4
    # Bytes of KV waiting to be persisted before new writes wait for old ones (back-pressure).
    max_pending_write_bytes: int = 256 << 20
    # torch intra-op threads for this process; None = torch's default. Engines sharing a host
    # want 1 each: on an oversubscribed CPU every OpenMP barrier waits a scheduler tick.
    num_threads: int | None = None
    # Upper bound of running sequences in one forward step.
    max_num_seqs: int = 64
    # Upper bound of tokens in one forward step; longer prompts are prefilled in chunks.
    max_num_batched_tokens: int = 8192
    # None = the checkpoint's max_position_embeddings.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be > 0, got {self.block_size_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_device_blocks is not None and self.num_device_blocks <= 0:
            raise ValueError(f"num_device_blocks must be > 0, got {self.num_device_blocks}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_io_threads <= 0:
            raise ValueError(f"num_io_threads must be > 0, got {self.num_io_threads}")
        if self.max_pending_write_bytes <= 0:
            raise ValueError(
                f"max_pending_write_bytes must be > 0, got {self.max_pending_write_bytes}"
            )
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be > 0 or None, got {self.num_threads}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
