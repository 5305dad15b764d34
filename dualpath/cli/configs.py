"""Where the command line's flags (or ``dualpath engine --config``'s file) become configs.

``store_config`` sizes the KV store, ``engine_config`` is the one place an ``EngineConfig`` is
built from flags, and ``engine_process_config`` is where ``dualpath engine``'s ``--config``
JSON and its flags meet.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

from dualpath.home import default_kv_store_dir
from dualpath.model.default import resolve_model_dir
from dualpath.units import gb_to_bytes
from dualpath.vllm.args import engine_kind_args

logger = logging.getLogger(__name__)

# Without --kv-store-capacity-gb the store may fill this fraction of its file system's free
# space at start: any client can send unique prompts, and an unbounded cache fills the disk.
DEFAULT_STORE_FREE_SPACE_FRACTION = 0.25


def store_config(root_dir: Path | None, capacity_gb: float | None):  # -> KVStoreConfig
    """The store's config from the flags; ``ValueError`` naming the flag for a bad budget, a
    budget without a store, or a ``root_dir`` that cannot be a directory.

    Without a budget it is ``DEFAULT_STORE_FREE_SPACE_FRACTION`` of the free space on the file
    system that holds (or will hold) ``root_dir``, measured now."""
    from dualpath.config import KVStoreConfig

    if root_dir is None:
        if capacity_gb is not None:
            raise ValueError(
                "--kv-store-capacity-gb sizes the KV store, and --no-kv-store has none: give one"
            )
        return KVStoreConfig()
    existing = Path(root_dir).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():  # the store would fail on its first block, after the model loaded
        where = "" if existing == Path(root_dir).absolute() else f": {existing}"
        raise ValueError(
            f"KV store {root_dir}{where} is not a directory; pass another --kv-store, or "
            "--no-kv-store"
        )
    if capacity_gb is not None:
        if not 0 < capacity_gb < float("inf"):
            raise ValueError(f"--kv-store-capacity-gb must be > 0 and finite, got {capacity_gb}")
        return KVStoreConfig(root_dir=root_dir, capacity_bytes=gb_to_bytes(capacity_gb))
    free_bytes = shutil.disk_usage(existing).free
    capacity_bytes = int(free_bytes * DEFAULT_STORE_FREE_SPACE_FRACTION)
    if capacity_bytes <= 0:
        raise ValueError(
            f"the file system of the KV store {root_dir} has no free space; free some, pass "
            "--kv-store-capacity-gb, or --no-kv-store"
        )
    logger.info(
        "KV store %s: capacity %.2f GB (%d%% of the %.2f GB free; --kv-store-capacity-gb sets it)",
        root_dir,
        capacity_bytes / 1e9,
        round(DEFAULT_STORE_FREE_SPACE_FRACTION * 100),
        free_bytes / 1e9,
    )
    return KVStoreConfig(root_dir=root_dir, capacity_bytes=capacity_bytes)


# Flags that may come with --config, where they must agree with it: they name the engine in a
# process list (`dualpath serve` passes them for that).
_ENGINE_IDENTITY = ("role", "engine_id", "node_id")


def engine_process_config(args: argparse.Namespace):
    """``dualpath engine``'s configuration: ``--config``'s JSON, or built from the flags."""
    given = [
        dest
        for dest, default in args.engine_flag_defaults.items()
        if getattr(args, dest) != default
    ]
    if args.config is not None:
        others = [dest for dest in given if dest not in _ENGINE_IDENTITY]
        if others:
            flags = ", ".join("--" + dest.replace("_", "-") for dest in others)
            raise ValueError(f"--config gives the whole configuration; leave out {flags}")
        config = _read_engine_config(args.config)
        for dest in _ENGINE_IDENTITY:  # given with --config: they name the same engine
            flag, configured = getattr(args, dest), getattr(config, dest)
            if flag is not None and flag != configured:
                raise ValueError(
                    f"--{dest.replace('_', '-')} {flag} differs from the --config's {configured}"
                )
        return config
    missing = [
        "--" + dest.replace("_", "-")
        for dest in ("role", "scheduler", "engine_id", "node_id")
        if getattr(args, dest) is None
    ]
    if missing:
        raise ValueError(f"give --config, or {', '.join(missing)}")
    return _engine_config_from_flags(args)


def _read_engine_config(source: str):  # -> EngineProcessConfig
    """``--config``'s JSON, from a file or '-' for stdin; ``ValueError`` naming the source and
    what is wrong (unreadable, not JSON, a required field missing, a bad field)."""
    import dataclasses

    from dualpath.config import EngineProcessConfig, config_from_dict

    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as exc:
        raise ValueError(f"--config {source}: cannot be read: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {source}: not JSON: {exc}") from exc
    missing = [
        field.name
        for field in dataclasses.fields(EngineProcessConfig)
        if isinstance(data, dict)
        and field.default is dataclasses.MISSING
        and field.name not in data
    ]
    if missing:
        raise ValueError(
            f"--config {source}: missing {', '.join(missing)} (an EngineProcessConfig, as "
            "'dualpath serve' sends its engines)"
        )
    try:
        return config_from_dict(EngineProcessConfig, data)
    except ValueError as exc:
        raise ValueError(f"--config {source}: {exc}") from exc


def _engine_config_from_flags(args: argparse.Namespace):
    model_dir = resolve_model_dir(args.model)
    return engine_process_from_flags(
        args,
        model_dir=model_dir,
        engine=engine_config(args, args.dtype or "float32", model_dir),
    )


def resolve_block_size(block_size: int | None, engine: str, model_dir: Path) -> int:
    """``--block-size``, or without it the size an engine of kind ``engine`` takes for the
    checkpoint in ``model_dir`` (``dualpath.vllm.args.engines_block_size``: 16 for an MLA model on
    vLLM's CPU build, else 64), logged so that a run says which it got."""
    if block_size is not None:
        return block_size
    if engine != "vllm":  # no need to read the checkpoint: ours takes 64 for every model
        from dualpath.config import EngineConfig

        return EngineConfig().block_size_tokens
    from dualpath.model.registry import read_config
    from dualpath.vllm.args import engines_block_size

    resolved = engines_block_size(engine, read_config(Path(model_dir) / "config.json"))
    logger.info("--block-size not given: %d tokens per KV block, vLLM's for this model", resolved)
    return resolved


def engine_process_from_flags(args: argparse.Namespace, *, model_dir: Path, engine, url: str = ""):
    """An ``EngineProcessConfig`` from the flags ``dualpath engine`` and ``dualpath
    vllm-config`` share (identity, scheduler, store, mode, links, buffer, heartbeat), with
    ``model_dir`` and ``engine`` (an ``EngineConfig``) as the command decides them."""
    from dualpath.config import (
        ClusterConfig,
        EngineProcessConfig,
        SchedulerConfig,
        TrafficConfig,
    )

    buffer_bytes = None if args.buffer_gb is None else gb_to_bytes(args.buffer_gb)
    quota = (
        {}
        if getattr(args, "attention_quota_s", None) is None
        else {"attention_quota_s": args.attention_quota_s}
    )
    return EngineProcessConfig(
        role=args.role,
        engine_id=args.engine_id,
        node_id=args.node_id,
        scheduler_endpoint=args.scheduler,
        model_dir=model_dir,
        store=store_config(
            None if args.no_kv_store else (args.kv_store or default_kv_store_dir()),
            args.kv_store_capacity_gb,
        ),
        engine=engine,
        cluster=ClusterConfig(
            mode=args.mode,
            traffic=TrafficConfig(
                snic_bandwidth_gbps=args.snic_gbps, cnic_bandwidth_gbps=args.cnic_gbps
            ),
            prefill_buffer_bytes=buffer_bytes,
            decode_buffer_bytes=buffer_bytes,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
        ),
        scheduler=SchedulerConfig(
            block_size_tokens=engine.block_size_tokens,
            min_prefill_chunk_tokens=engine.block_size_tokens,
            **quota,
        ),
        transport=args.transport,
        url=url,
    )


def engine_config(args: argparse.Namespace, dtype: str, model_dir: Path):  # -> EngineConfig
    """The engines' config from the engine flags (``options.add_engine_arguments`` and the
    KV cache and batch sizes) for the checkpoint in ``model_dir``, with ``dtype`` resolved by
    the caller (``serve`` reads the checkpoint's, ``engine`` defaults to float32) and the
    block size here (``resolve_block_size``)."""
    from dualpath.config import EngineConfig

    kind = engine_kind_args(args)
    return EngineConfig(
        block_size_tokens=resolve_block_size(args.block_size, kind["engine"], model_dir),
        device=args.device,
        dtype=dtype,
        kv_cache_bytes=gb_to_bytes(args.kv_cache_gb),
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        num_decode_threads=getattr(args, "decode_threads", None),  # serve's alone
        max_num_batched_tokens=args.max_num_batched_tokens,
        **kind,
    )
