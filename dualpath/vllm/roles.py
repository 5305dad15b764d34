"""A PE and a DE whose model runs on vLLM (``--engine vllm``), behind the same ``RoleEngine``
interface as ours (``dualpath.engine.role``): the same messages in and out, the same buffers,
store reads and transport (``prefill.py``, ``decode.py``; ``make_vllm_role`` builds either).

    VllmPrefillRole   Assignment -> PE-side hit blocks read into the PE buffer (StoreReader, as
                      ours); with DecodeReady, the request goes to vLLM for one token, its
                      connector plan loading the hits per layer (the PE side's from the
                      buffer, the DE side's pulled from the DE's buffer) and sending every
                      layer's KV the DE does not hold to the DE's buffer -> PrefillDone
    VllmDecodeRole    Assignment -> buffer slots for the whole prompt, DE-side hit blocks read
                      into them -> DecodeReady; with PrefillDone, the request goes to vLLM as
                      prompt + first token, its plan loading the prompt's KV from the buffer
                      (then freed) and persisting every block not in the store -> TokenUpdates,
                      KVPersisted

A PE's vLLM keeps the KV of prompts it computed in its prefix cache: hit blocks it still holds
are read by neither side (``num_engine_cached_bytes`` counts them, so that the sides' reads
plus these equal the cached tokens' KV). The PE tells the DE how many it holds (PrefillHeld,
relayed by the scheduler as soon as the PE takes the request), and the DE starts its side's
reads once it knows, skipping those; the PE sends them with the rest the DE lacks. Where the
PE does not look its prompts up (a vLLM server's, ``served.py``) it says so once
(``EngineInfo.reports_prefill_held``): the scheduler's Assignment then tells both engines
there is nothing to wait for (``is_prefill_held_sent``), and the DE reads at once. A seeded
sampler restarts on the DE (vLLM samples the DE's tokens), so only greedy requests give one
vLLM instance's exact tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dualpath.config import EngineProcessConfig
from dualpath.engine.buffers import KVBuffer
from dualpath.engine.remote_buffer import TransportStaging
from dualpath.engine.role import MAX_PROFILED_CONTEXT_TOKENS, DecodePeers, prefill_batcher
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.store import KVStore
from dualpath.model.identity import KVIdentity, vllm_device, vllm_page_order
from dualpath.protocol import DECODE
from dualpath.scheduler.batching import PrefillBatcher
from dualpath.transfer.traffic import Mover
from dualpath.transfer.transport import Transport
from dualpath.vllm.args import check_engine_kind
from dualpath.vllm.connector import ConnectorHost, register_host
from dualpath.vllm.decode import VllmDecodeRole
from dualpath.vllm.engine import VllmEngineSpec, build_engine, profile_vllm_layer_time
from dualpath.vllm.prefill import VllmPrefillRole

logger = logging.getLogger(__name__)


def connector_host(
    config: EngineProcessConfig, identity: KVIdentity, page_order: str, mover: Mover
) -> tuple[ConnectorHost, FileKVStore | None]:
    """The connector's host for the engine ``config`` describes, and the engine's store (a PE
    reads it; only a DE's host persists into it)."""
    engine_config = config.engine
    store = (
        FileKVStore.from_config(config.store, identity.layout, identity.fingerprint)
        if config.store.is_enabled
        else None
    )
    host = ConnectorHost(
        identity.layout,
        identity.fingerprint,
        store=store if config.role == DECODE else None,  # a PE persists nothing (SPEC §2)
        mover=mover,
        is_layerwise=config.cluster.settings.is_layerwise,
        num_io_threads=engine_config.num_io_threads,
        max_pending_write_bytes=engine_config.max_pending_write_bytes,
        page_order=page_order,
    )
    return host, store


def vllm_role(
    engine: Any,
    host: ConnectorHost,
    config: EngineProcessConfig,
    identity: KVIdentity,
    buffer: KVBuffer,
    transport: Transport,
    *,
    store: KVStore | None,
    max_context_tokens: int,
    eos_token_ids: tuple[int, ...],
    mover: Mover,
    wake: Callable[[], None],
    batcher: PrefillBatcher | None = None,
) -> VllmPrefillRole | VllmDecodeRole:
    """The role ``config.role`` names over a vLLM engine and its connector's host; a PE's
    staging ring holds ``max_context_tokens`` of blocks."""
    num_io_threads = config.engine.num_io_threads
    if config.role == DECODE:
        return VllmDecodeRole(
            engine,
            host,
            buffer,
            wake=wake,
            eos_token_ids=eos_token_ids,
            num_io_threads=num_io_threads,
        )
    max_blocks = -(-max_context_tokens // identity.layout.block_size_tokens)
    staging = TransportStaging(
        transport, identity.layout, max_read_blocks=max_blocks, ring_blocks=max_blocks
    )
    return VllmPrefillRole(
        engine,
        host,
        buffer,
        DecodePeers(transport, staging, peer_timeout_s=config.transfer_timeout_s),
        store=store,
        mover=mover,
        wake=wake,
        eos_token_ids=eos_token_ids,
        num_io_threads=num_io_threads,
        batcher=batcher,
    )


def make_vllm_role(
    config: EngineProcessConfig,
    model_config: Any,
    identity: KVIdentity,
    buffer: KVBuffer,
    transport: Transport,
    *,
    mover: Mover,
    wake: Callable[[], None],
    engine: Any = None,
) -> VllmPrefillRole | VllmDecodeRole:
    """The engine ``config.role`` names, on a vLLM engine built in this process with our
    connector; the process is pinned to one core per thread (vLLM's CPU build ignores its own
    binding variable in-process), engine ``e`` of a host on cores ``e * threads ...``.

    ``engine``: a vLLM engine that runs its own loop (a vLLM server's, ``served.py``),
    seen through the same calls; its connector host is ``engine.host``. Nothing is built."""
    engine_config = config.engine
    check_engine_kind(config.cluster, engine_config, model_config)
    if engine is not None:
        return vllm_role(
            engine,
            engine.host,
            config,
            identity,
            buffer,
            transport,
            store=engine.store,
            max_context_tokens=engine.max_model_len,
            eos_token_ids=engine.eos_token_ids,
            mover=mover,
            wake=wake,
        )
    host, store = connector_host(
        config, identity, vllm_page_order(model_config, vllm_device()), mover
    )
    key = f"engine-{config.engine_id}"
    register_host(key, host)
    num_threads = engine_config.num_threads or 1
    num_cores = os.cpu_count() or 1
    first_core = (config.engine_id * num_threads) % num_cores
    cores = tuple(sorted({(first_core + i) % num_cores for i in range(num_threads)}))
    engine = build_engine(
        VllmEngineSpec(
            Path(config.model_dir),
            engine_key=key,
            block_size_tokens=engine_config.block_size_tokens,
            dtype=engine_config.dtype,
            max_model_len=engine_config.max_model_len,
            kv_cache_bytes=engine_config.kv_cache_bytes,
            # The engine's KV memory as configured, not rounded to vLLM's whole GiB.
            num_kv_blocks=engine_config.num_device_blocks
            or engine_config.kv_cache_bytes // identity.layout.full_block_bytes,
            cores=cores,
            args=engine_config.vllm_args,
        )
    )
    eos_token_ids = tuple(model_config.eos_token_ids)
    batcher = None
    if config.role != DECODE and engine_config.vllm_prefill_batching == "quota":
        max_model_len = engine_config.max_model_len or model_config.max_position_embeddings
        predictor = profile_vllm_layer_time(
            engine,
            # A profiled prompt reaches the whole context, and vLLM adds one output token.
            max_context_tokens=min(max_model_len - 1, MAX_PROFILED_CONTEXT_TOKENS),
            num_layers=identity.layout.num_layers,
        )
        batcher = prefill_batcher(config, predictor)
        logger.info(
            "prefill batching: quota %.4f s a layer; vLLM's profile predicts %.4f s a layer "
            "for 1,024 new tokens, %.4f s for 1,024 after 1,024 cached",
            batcher.quota_s,
            predictor.predict_s([(0, 1024)]),
            predictor.predict_s([(1024, 1024)]),
        )
    return vllm_role(
        engine,
        host,
        config,
        identity,
        buffer,
        transport,
        store=store,
        max_context_tokens=model_config.max_position_embeddings,
        eos_token_ids=eos_token_ids,
        mover=mover,
        wake=wake,
        batcher=batcher,
    )
