"""The vLLM engine one engine process of ours runs: in this process, stepped by us, our connector
inside it (``connector.py``), bound to its cores; and the requests we give it.

    engine = build_engine(VllmEngineSpec(model_dir, engine_key="engine-3", cores=(1,)))
    params = vllm_sampling_params(SamplingParams(), max_tokens=16, min_tokens=0)
    engine.add_request("7", vllm_prompt(ids, cache_salt=None), with_plan(params, 7))
    outputs = engine.step()

vLLM's CPU build ignores ``VLLM_CPU_OMP_THREADS_BIND`` in-process and fixes torch's thread
count when its worker starts, so the cores and threads are set here, before the engine is
built. Engine arguments a user passes through are vLLM's own, except the ones this module
sets (they would break what the connector relies on): those are refused by name.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualpath.types import SamplingParams
from dualpath.units import GIB
from dualpath.vllm.args import check_vllm_args

CONNECTOR_NAME = "DualpathConnector"
CONNECTOR_MODULE = "dualpath.vllm.connector"


@dataclass(frozen=True, slots=True)
class VllmEngineSpec:
    """One vLLM engine of ours."""

    model_dir: Path
    engine_key: str  # the ConnectorHost this engine's connector uses
    block_size_tokens: int = 64  # = the store's Full Block (vLLM's CPU kernel: a multiple of 32)
    dtype: str = "float32"
    max_model_len: int | None = None
    kv_cache_bytes: int = 1 << 30  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB)
    # Exactly this many KV blocks (vLLM's num_gpu_blocks_override; within kv_cache_bytes rounded
    # up to GiB); None: as many as kv_cache_bytes holds.
    num_kv_blocks: int | None = None
    cores: tuple[int, ...] | None = None  # pin the process here; None: leave it as it is
    # vLLM engine arguments passed through (EngineArgs field -> value); RESERVED_ARGS refused.
    args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_vllm_args(self.args)


def build_engine(spec: VllmEngineSpec) -> Any:
    """vLLM's ``LLMEngine`` for ``spec``, its engine core in this process."""
    import torch

    if spec.cores is not None:
        os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(len(spec.cores))  # before vLLM's worker freezes the count
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, -(-spec.kv_cache_bytes // GIB)))
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = dict(
        model=str(spec.model_dir),
        dtype=spec.dtype,
        block_size=spec.block_size_tokens,
        max_model_len=spec.max_model_len,
        seed=0,
        enable_prefix_caching=True,
        enforce_eager=True,  # compiled graphs take minutes to build on a CPU at every start
        disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector=CONNECTOR_NAME,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config={"engine_key": spec.engine_key},
            # A block whose pull from a DE failed: vLLM fails the request (the engine then
            # re-places it) and evicts the block, so its prefix cache never holds it.
            kv_load_failure_policy="fail",
        ),
    )
    if spec.num_kv_blocks is not None:
        args["num_gpu_blocks_override"] = spec.num_kv_blocks
    args.update(mla_args(spec.model_dir))
    args.update(spec.args)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def step_between_layers(engine: Any, host: Any, between_layers: Callable[[], None]) -> list:
    """One step of ``engine``, ``between_layers`` called after each layer's KV is saved (the
    connector's hook, ``host.between_layers``): the engine process takes the scheduler's
    messages and reports mid-step. An engine that steps itself on another thread (a vLLM
    server's) is not ours to call into: its step is only waited for."""
    if getattr(engine, "steps_itself", False):
        return engine.step()
    host.between_layers = between_layers
    try:
        return engine.step()
    finally:
        host.between_layers = None


def mla_args(model_dir: Path) -> dict[str, Any]:
    """vLLM's settings for an MLA model (DeepSeek-V3's latent KV) on a CPU, {} otherwise.

    The ``CPU_MLA`` backend, whichever CPU: a host with AMX tiles would get ``AMX_MLA``,
    which takes bfloat16 only and 128-token blocks, so the same command would give another
    engine (and other pages) on another host. ``CPU_MLA`` serves 16-token blocks only (vLLM
    forces its block size to 16). And vLLM's custom rotary-embedding op is left out: in eager
    mode (every op custom) it rotates MLA's strided rope keys at the wrong positions, which
    makes a prefill's cached keys depend on the batch (measured: vLLM 0.32, CPU)."""
    import json

    from vllm.platforms import current_platform

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if not config.get("kv_lora_rank") or not current_platform.is_cpu():
        return {}
    return {
        "attention_backend": "CPU_MLA",
        "compilation_config": {"custom_ops": ["all", "-rotary_embedding"]},
    }


def vllm_sampling_params(params: SamplingParams, *, max_tokens: int, min_tokens: int) -> Any:
    """vLLM's sampling parameters for ours. Stop strings are vLLM's to find on the DE (it
    detokenizes only then); as on our engines, the PE's first token is not checked for them."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
        logprobs=params.logprobs,
        stop=list(params.stop) or None,
        output_kind=RequestOutputKind.DELTA,
        detokenize=bool(params.stop),
    )


def logprobs_of(output: Any, token_ids: list[int]) -> list | None:
    """Our (logprob, top) pairs for vLLM's per-token logprob dicts, or None."""
    if output.logprobs is None:
        return None
    result = []
    for token_id, entry in zip(token_ids, output.logprobs, strict=True):
        top = sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda item: -item[1])
        result.append((entry[token_id].logprob, tuple(top)))
    return result


def vllm_prompt(token_ids: Sequence[int], *, cache_salt: str | None) -> dict[str, Any]:
    """vLLM's token-id prompt, salted with ``cache_salt`` if one is given: vLLM's prefix cache
    then keeps it apart as it keeps the store's blocks apart (``kv.hashing``)."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def with_plan(vllm_params: Any, request_id: int) -> Any:
    """``vllm_params`` naming the ``KVPlan`` the connector follows for the request."""
    from dualpath.vllm.connector import REQUEST_ID_PARAM  # lazy as every vLLM import here

    vllm_params.extra_args = {"kv_transfer_params": {REQUEST_ID_PARAM: request_id}}
    return vllm_params


class PrefixCacheProbe:
    """How many leading full blocks of a prompt vLLM's own prefix cache holds right now: the
    blocks a PE need not read from the store (vLLM will not ask its connector for them).

    It hashes the prompt's blocks the way vLLM's engine does for a token-id request, salted
    or not (no LoRA, multimodal input or prompt embeddings: our requests carry none), and
    looks each up in vLLM's block pool. A look-up alone does not keep the blocks: vLLM may
    evict one before the request is scheduled (the connector then finds a smaller local hit
    than planned and loads nothing: vLLM recomputes, slower, never wrong). So a PE ``pin``s
    what it counts on: the blocks stay in vLLM's cache (a reference each, as a running request
    holds them) until it ``unpin``s them, at most ``max_pinned_fraction`` of vLLM's blocks at
    once."""

    def __init__(self, engine: Any) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name

        core = engine.engine_core.engine_core
        config = core.vllm_config.cache_config
        manager = core.scheduler.kv_cache_manager
        self.enabled = bool(config.enable_prefix_caching and manager.enable_caching)
        self.block_size = config.block_size
        self._pool = manager.block_pool
        self._hash = get_hash_fn_by_name(config.prefix_caching_hash_algo)
        self.num_pinned = 0  # blocks pinned and not unpinned (with multiplicity)

    def block_hashes(
        self, token_ids: Sequence[int], num_blocks: int, cache_salt: str | None = None
    ) -> list[Any]:
        """vLLM's hashes of the first ``num_blocks`` full blocks of ``token_ids`` in a request
        salted with ``cache_salt``: vLLM mixes a salt into the first block's extra keys
        (``kv_cache_utils.generate_block_hash_extra_keys``), and the chain carries it on."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        hashes: list[Any] = []
        parent = None
        extra_keys = (("cache_salt", cache_salt),) if cache_salt else None
        for index in range(num_blocks):
            tokens = token_ids[index * self.block_size : (index + 1) * self.block_size]
            parent = hash_block_tokens(self._hash, parent, tokens, extra_keys)
            hashes.append(parent)
            extra_keys = None  # the first block's only
        return hashes

    def num_cached_blocks(
        self, token_ids: Sequence[int], max_blocks: int, cache_salt: str | None = None
    ) -> int:
        """Leading blocks of ``token_ids`` (at most ``max_blocks``) in vLLM's prefix cache, for
        a request salted with ``cache_salt``."""
        return len(self._cached_blocks(token_ids, max_blocks, cache_salt))

    def _cached_blocks(
        self, token_ids: Sequence[int], max_blocks: int, cache_salt: str | None
    ) -> list[Any]:
        if not self.enabled:
            return []
        max_blocks = min(max_blocks, (len(token_ids) - 1) // self.block_size)  # vLLM's cap
        blocks = []
        for block_hash in self.block_hashes(token_ids, max(max_blocks, 0), cache_salt):
            found = self._pool.get_cached_block(block_hash, [0])
            if found is None:
                break
            blocks.append(found[0])
        return blocks

    def pin(
        self,
        token_ids: Sequence[int],
        max_blocks: int,
        max_pinned_fraction: float = 0.5,
        *,
        cache_salt: str | None = None,
    ) -> list[Any]:
        """The leading blocks of ``token_ids`` (at most ``max_blocks``) vLLM's prefix cache
        holds for a request salted with ``cache_salt``, kept there until ``unpin``; fewer when
        pins would pass ``max_pinned_fraction`` of vLLM's blocks (the rest of the cache stays
        free for running requests)."""
        budget = int(self._pool.num_gpu_blocks * max_pinned_fraction) - self.num_pinned
        blocks = self._cached_blocks(token_ids, max_blocks, cache_salt)[: max(budget, 0)]
        self._pool.touch(blocks)
        self.num_pinned += len(blocks)
        return blocks

    def unpin(self, blocks: Sequence[Any]) -> None:
        """Give back ``pin``'s blocks (the last block first in line for eviction, as vLLM
        frees a request's)."""
        self._pool.free_blocks(reversed(blocks))
        self.num_pinned -= len(blocks)


def profile_vllm_layer_time(
    engine: Any, *, max_context_tokens: int, num_layers: int, num_repeats: int = 2, seed: int = 0
) -> Any:  # -> FittedAttentionTimePredictor
    """The compute-quota batcher's predictor (SPEC §6) for a vLLM engine: the batches the
    native PE profiles (``profile_batches``), each run through vLLM itself, its cached tokens
    in vLLM's prefix cache (computed by an earlier request), the new ones fresh each repeat;
    a batch's time is its steps' wall time over ``num_layers`` (median of ``num_repeats``,
    after one warm-up). vLLM's prefix cache is emptied after. The engine must be idle."""
    import random
    import statistics
    import time

    from vllm import SamplingParams

    from dualpath.engine.profile import profile_batches
    from dualpath.scheduler.attention_predictor import (
        AttentionProfileSample,
        FittedAttentionTimePredictor,
    )

    if engine.has_unfinished_requests():
        raise RuntimeError("profile a vLLM engine before it takes requests")  # a bug
    config = engine.engine_core.engine_core.vllm_config
    block_size = config.cache_config.block_size
    vocab_size = config.model_config.get_vocab_size()
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0)
    ids = itertools.count()

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    def run(prompts: list[list[int]]) -> float:
        for prompt in prompts:
            engine.add_request(f"profile-{next(ids)}", {"prompt_token_ids": prompt}, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    samples = []
    for chunks in profile_batches(max_context_tokens):
        # vLLM caches whole blocks: the cached part is rounded down to them.
        chunks = tuple((cached // block_size * block_size, new) for cached, new in chunks)
        prefixes = [tokens(cached) for cached, _ in chunks]
        times_s = []
        for _ in range(num_repeats + 1):
            run([prefix for prefix in prefixes if prefix])  # in vLLM's prefix cache now
            times_s.append(
                run([p + tokens(new) for p, (_, new) in zip(prefixes, chunks, strict=True)])
            )
        samples.append(AttentionProfileSample(chunks, statistics.median(times_s[1:]) / num_layers))
    engine.reset_prefix_cache()
    return FittedAttentionTimePredictor.fit(samples)
