"""One vLLM engine in this process with the store behind it: ``dualpath generate --engine vllm``,
the shape of our ``LLM`` (and of ``vllm.LLM``).

    with VllmLLM(model_dir, kv_store="path/to/kv") as llm:
        out = llm.generate([ids], SamplingParams(max_tokens=16))[0]

Each request's leading full blocks found in the store are read into a host buffer of its own;
the connector loads them into vLLM's paged cache layer by layer (``KVTransfer.load``, a hit vLLM
already holds is not loaded again) and persists every full block beyond them, of the prompt and
of the output, as it fills (``KVTransfer.persist_from_block``): the same blocks, under the same keys
and fingerprint, as ``dualpath serve --engine vllm`` writes and reads.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dualpath.config import KVStoreConfig
from dualpath.engine.buffers import KVBuffer
from dualpath.engine.courier import KVTransfer, LoadSource
from dualpath.engine.llm import Prompt, encode_prompt, prompt_cache_salt
from dualpath.engine.output import RequestOutput
from dualpath.errors import KVStoreError
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.hashing import block_keys
from dualpath.model.identity import checkpoint_kv_identity, vllm_device, vllm_page_order
from dualpath.model.tokenizer import Tokenizer
from dualpath.types import SamplingParams
from dualpath.vllm.connector import ConnectorHost, register_host, unregister_host
from dualpath.vllm.engine import (
    VllmEngineSpec,
    build_engine,
    vllm_prompt,
    vllm_sampling_params,
    with_plan,
)

_ENGINE_KEYS = itertools.count()


class VllmLLM:
    """Offline generation on one vLLM engine, its KV reused from and persisted to our store."""

    def __init__(
        self,
        model: str | Path,
        *,
        kv_store: str | Path | None = None,
        kv_store_capacity_bytes: int | None = None,
        dtype: str | None = None,
        block_size: int = 64,
        max_model_len: int | None = None,
        kv_cache_bytes: int = 1 << 30,
        num_threads: int | None = None,
        vllm_args: dict[str, Any] | None = None,
    ) -> None:
        model_dir = Path(model)
        config, identity = checkpoint_kv_identity(
            model_dir, dtype, block_size, "vllm", vllm_device()
        )
        self.layout = identity.layout
        self.fingerprint = identity.fingerprint
        self.block_size = block_size
        self.tokenizer = Tokenizer(model_dir / "tokenizer.json")
        self.store = None
        if kv_store is not None:
            store_config = KVStoreConfig(Path(kv_store), capacity_bytes=kv_store_capacity_bytes)
            self.store = FileKVStore.from_config(store_config, self.layout, self.fingerprint)
        self.host = ConnectorHost(
            self.layout,
            self.fingerprint,
            store=self.store,
            page_order=vllm_page_order(config, vllm_device()),
        )
        self._key = f"llm-{os.getpid()}-{next(_ENGINE_KEYS)}"
        register_host(self._key, self.host)
        cores = None
        if num_threads is not None:
            allowed = sorted(os.sched_getaffinity(0))
            cores = tuple(allowed[: max(1, min(num_threads, len(allowed)))])
        try:
            self.engine = build_engine(
                VllmEngineSpec(
                    model_dir,
                    engine_key=self._key,
                    block_size_tokens=block_size,
                    dtype=dtype or config.torch_dtype,
                    max_model_len=max_model_len,
                    kv_cache_bytes=kv_cache_bytes,
                    cores=cores,
                    args=vllm_args or {},
                )
            )
        except BaseException:
            self.close()
            raise
        self._next_id = 0

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate for every prompt, one after another (each finds the blocks the ones before
        it persisted in its namespace: a prompt dict's ``cache_salt``, as in vLLM), after its
        blocks are in the store."""
        params = params or SamplingParams()
        salted = [(self.encode_prompt(p), prompt_cache_salt(p)) for p in prompts]
        return [self._generate_one(ids, params, salt) for ids, salt in salted]

    def _generate_one(
        self, prompt: list[int], params: SamplingParams, cache_salt: str | None
    ) -> RequestOutput:
        self._next_id += 1
        request_id = self._next_id
        arrival_s = time.perf_counter()
        buffer, slots, num_hit = self._read_hits(prompt, cache_salt)
        load_s = time.perf_counter() - arrival_s
        plan = KVTransfer(
            request_id,
            load=None if not num_hit else LoadSource(buffer, slots, num_hit * self.block_size),
            persist_from_block=num_hit,
        )
        self.host.plans[request_id] = plan
        vllm_params = vllm_sampling_params(
            params, max_tokens=params.max_tokens, min_tokens=params.min_tokens
        )
        token_ids: list[int] = []
        text, finish_reason, first_token_s, num_cached = "", None, None, 0
        try:
            self.engine.add_request(
                str(request_id),
                vllm_prompt(prompt, cache_salt=cache_salt),
                with_plan(vllm_params, request_id),
            )
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    completion = output.outputs[0]
                    if completion.token_ids and first_token_s is None:
                        first_token_s = time.perf_counter()
                    token_ids += completion.token_ids
                    text += completion.text
                    num_cached = output.num_cached_tokens or 0
                    if output.finished:
                        finish_reason = completion.finish_reason
        finally:
            del self.host.plans[request_id]
        if self.host.store_io is not None:
            self.host.store_io.flush()
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=prompt,
            token_ids=token_ids,
            text=text if params.stop else self.tokenizer.decode(token_ids),
            finish_reason=finish_reason or "length",
            num_cached_tokens=num_cached,
            logprobs=None,
            arrival_s=arrival_s,
            first_token_s=first_token_s,
            finish_s=time.perf_counter(),
            load_s=load_s,
            num_preemptions=0,
            written_block_keys=tuple(plan.persisted_keys[num_hit:]),
        )

    def _read_hits(
        self, prompt: list[int], cache_salt: str | None
    ) -> tuple[KVBuffer | None, list[int], int]:
        """The prompt's leading full blocks the store holds under ``cache_salt``, read into a
        buffer of their own (the last prompt token is always computed: its logits pick the
        first output)."""
        if self.store is None:
            return None, [], 0
        keys = block_keys(
            prompt[: (len(prompt) - 1) // self.block_size * self.block_size],
            self.block_size,
            self.fingerprint,
            cache_salt=cache_salt,
        )
        num_hit = self.store.lookup(keys)
        if not num_hit:
            return None, [], 0
        buffer = KVBuffer(self.layout, num_hit * self.layout.full_block_bytes)
        slots = buffer.allocate(num_hit)
        for index, (key, slot) in enumerate(zip(keys[:num_hit], slots, strict=True)):
            try:
                self.store.read(key, buffer.full_block(slot))
            except KVStoreError:  # gone or corrupt since the lookup: computed from there
                return buffer, slots[:index], index
        return buffer, slots, num_hit

    def close(self) -> None:
        if self.host.store_io is not None:
            self.host.store_io.close()
        if self.store is not None:
            self.store.close()
        unregister_host(self._key)

    def __enter__(self) -> VllmLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
