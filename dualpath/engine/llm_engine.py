"""``LLMEngine``: one engine's step loop over a paged KV cache, with the store underneath.

Every turn looks the prompt's full blocks up in the store, loads the longest cached prefix
into the paged cache, prefills only the rest (batched with other sequences' chunks and decode
steps), and persists every full block of the prompt and the output as it fills. A step is
three calls, as in ``LLMEngine.step``: admit and schedule, run the model, post-process.

Why a sequence stops and what a finished request returns live in ``output.py``; the offline
``LLM`` API that drives this engine lives in ``llm.py``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from dualpath.config import EngineConfig, KVStoreConfig
from dualpath.engine.kv_cache import PagedKVCache, num_blocks_for_bytes
from dualpath.engine.kv_io import KVStoreIO
from dualpath.engine.output import RequestOutput, finish_reason, request_output
from dualpath.engine.runner import ModelRunner, ScheduledSeq
from dualpath.engine.sampling import (
    SamplingParams,
    TokenLogprob,
    banned_token_ids,
    make_generator,
    next_generator,
    sample,
)
from dualpath.engine.sequence import Sequence, SequenceStatus
from dualpath.kv.block_pool import BlockPool
from dualpath.kv.file_store import FileKVStore
from dualpath.model.identity import kv_identity
from dualpath.model.loader import LoadedModel
from dualpath.transfer.traffic import Mover, direct_move
from dualpath.types import check_cache_salt

logger = logging.getLogger(__name__)


class LLMEngine:
    """One engine: a paged KV cache, continuous batching, and the store underneath."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        store_config: KVStoreConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        mover: Mover = direct_move,
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.clock = clock
        self.block_size = config.block_size_tokens
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide, as torch has it
        model_config = loaded.config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the checkpoint's "
                f"max_position_embeddings {model_config.max_position_embeddings}"
            )
        entry_shape = loaded.model.cache_entry_shape
        num_blocks = config.num_device_blocks or num_blocks_for_bytes(
            model_config.num_layers,
            entry_shape,
            self.block_size,
            loaded.dtype,
            config.kv_cache_bytes,
        )
        if num_blocks <= 0:
            raise ValueError(f"kv_cache_bytes {config.kv_cache_bytes} holds no block")
        self.cache = PagedKVCache(
            num_layers=model_config.num_layers,
            entry_shape=entry_shape,
            num_blocks=num_blocks,
            block_size=self.block_size,
            dtype=loaded.dtype,
            device=loaded.device,
        )
        self.pool = BlockPool(num_blocks)
        self.runner = ModelRunner(loaded.model, self.cache)
        identity = kv_identity(
            model_config,
            loaded.weights_digest,
            str(loaded.dtype).removeprefix("torch."),
            self.block_size,
        )
        assert identity.layout == self.cache.layout, "cache and store layouts must agree"
        self.fingerprint = identity.fingerprint
        self.store_io: KVStoreIO | None = None
        if store_config.is_enabled:
            store = FileKVStore.from_config(store_config, self.cache.layout, self.fingerprint)
            self.store_io = KVStoreIO(
                store,
                self.cache,
                num_io_threads=config.num_io_threads,
                max_pending_write_bytes=config.max_pending_write_bytes,
                mover=mover,
            )
        self.eos_token_ids = model_config.eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self._new_tokens: dict[int, list[int]] = {}
        self._new_logprobs: dict[int, list[TokenLogprob]] = {}
        self._finished_outside_step: list[RequestOutput] = []
        self.running: list[Sequence] = []
        self._request_ids = itertools.count()

    # --- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        request_id: int | None = None,
        *,
        cache_salt: str | None = None,
    ) -> int:
        """Queue a request and return its id: ``request_id`` (the caller's to keep unique, as a
        cluster's scheduler does), or the next of this engine's own count. Its blocks are
        looked up and persisted in ``cache_salt``'s namespace (``kv.hashing``). ``ValueError``
        names the problem for bad input."""
        prompt = list(prompt_token_ids)
        self.validate_request(prompt, params)
        check_cache_salt(cache_salt)
        if request_id is None:
            request_id = next(self._request_ids)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            arrival_s=self.clock(),
            generator=make_generator(params),
            cache_salt=cache_salt,
        )
        self.waiting.append(seq)
        return request_id

    def validate_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if the request could never run."""
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab_size = self.loaded.config.vocab_size
        for position, token_id in enumerate(prompt):
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise ValueError(f"token id at position {position} is not an integer: {token_id!r}")
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"token id {token_id} at position {position} is outside the vocabulary "
                    f"[0, {vocab_size})"
                )
        if len(prompt) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens, longer than the model's context "
                f"of {self.max_model_len}"
            )
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context of {self.max_model_len} tokens"
            )
        num_blocks = -(-(len(prompt) + params.max_tokens) // self.block_size)
        if num_blocks > self.pool.num_blocks:
            raise ValueError(
                f"request needs {num_blocks} KV blocks but the engine has only "
                f"{self.pool.num_blocks}; raise the KV cache size"
            )

    def abort_request(self, request_id: int) -> bool:
        """Drop a waiting or running request and free its blocks; False if unknown."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._release(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    self._new_tokens.pop(request_id, None)
                    self._new_logprobs.pop(request_id, None)
                    return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._finished_outside_step)

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, schedule, run one forward, sample; return the requests that finished."""
        finished, self._finished_outside_step = self._finished_outside_step, []
        self._admit_waiting()
        work = self._schedule()
        if not work:
            return finished
        logits = self.runner.execute(work)
        return finished + self._postprocess(work, logits)

    def _admit_waiting(self) -> None:
        """FIFO: admit while a sequence slot and blocks for its whole current context are free."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_blocks = -(-seq.num_tokens // self.block_size)
            # Keep one block per running sequence free so decodes do not preempt at once.
            reserve = len(self.running) if self.running else 0
            if not self.pool.can_allocate(num_blocks + reserve):
                break
            self.waiting.popleft()
            seq.block_table = self.pool.allocate(num_blocks)
            seq.status = SequenceStatus.RUNNING
            self._load_cached_prefix(seq)
            self.running.append(seq)

    def _load_cached_prefix(self, seq: Sequence) -> None:
        loaded = 0
        if self.store_io is not None:
            start_s = self.clock()
            num_full = seq.num_tokens // self.block_size
            seq.ensure_block_keys(num_full, self.block_size, self.fingerprint)
            keys = seq.block_keys[:num_full]
            num_hit = self.store_io.lookup(keys)
            loaded = self.store_io.load(keys[:num_hit], seq.block_table[:num_hit])
            seq.num_persisted_blocks = loaded
            seq.load_s += self.clock() - start_s
        # At least the last token is computed: its logits pick the next token. When every
        # block hit, its KV is recomputed over the loaded copy (the block is already stored).
        seq.num_computed_tokens = min(loaded * self.block_size, seq.num_tokens - 1)
        if not seq.is_admitted_once:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.is_admitted_once = True

    def _schedule(self) -> list[ScheduledSeq]:
        """Running sequences in admission order, within the token budget; preempt the newest
        (recompute later, its stored blocks will hit) when blocks run out."""
        budget = self.config.max_num_batched_tokens
        work: list[ScheduledSeq] = []
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            num_blocks = -(-(seq.num_computed_tokens + num_new) // self.block_size)
            needed = num_blocks - len(seq.block_table)
            while needed > 0 and not self.pool.can_allocate(needed):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            if needed > 0:
                seq.block_table.extend(self.pool.allocate(needed))
            work.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            index += 1
        return work

    def _preempt(self, seq: Sequence) -> None:
        logger.info("preempting %s (KV memory full); it will be recomputed", seq.request_id)
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []

    def _postprocess(self, work: list[ScheduledSeq], logits: torch.Tensor) -> list[RequestOutput]:
        now_s = self.clock()
        finished: list[RequestOutput] = []
        row = 0
        for item in work:
            seq = item.seq
            is_sampling = item.is_sampling
            seq.num_computed_tokens += item.num_new_tokens
            self._persist_full_blocks(seq)
            if not is_sampling:
                continue
            params = seq.params
            generator = next_generator(params, len(seq.output_token_ids), seq.generator)
            token_id, logprob = sample(logits[row], params, generator, self._banned_tokens(seq))
            row += 1
            output = self._append_token(seq, token_id, logprob, now_s)
            if output is not None:
                finished.append(output)
        return finished

    def _append_token(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, now_s: float
    ) -> RequestOutput | None:
        """Record a sampled token; finish the sequence (freeing its blocks) if it stops here."""
        seq.output_token_ids.append(token_id)
        self._new_tokens.setdefault(seq.request_id, []).append(token_id)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
            self._new_logprobs.setdefault(seq.request_id, []).append(logprob)
        if seq.first_token_s is None:
            seq.first_token_s = now_s
        seq.finish_reason = finish_reason(
            seq, token_id, self.eos_token_ids, self.loaded.tokenizer, self.max_model_len
        )
        if seq.finish_reason is None:
            return None
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_s = now_s
        return request_output(seq, self.loaded.tokenizer, self.block_size)

    def pop_new_tokens(self) -> dict[int, list[int]]:
        """Tokens sampled since the last call, by request (for streaming)."""
        new_tokens, self._new_tokens = self._new_tokens, {}
        return new_tokens

    def pop_new_logprobs(self) -> dict[int, list[TokenLogprob]]:
        """Log-probabilities of the tokens sampled since the last call, by request, aligned
        with ``pop_new_tokens`` (only requests that asked for them)."""
        new_logprobs, self._new_logprobs = self._new_logprobs, {}
        return new_logprobs

    def add_prefilled(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        first_token_id: int,
        first_logprob: TokenLogprob | None,
        num_cached_tokens: int,
        fill_blocks: Callable[[list[int]], None],
        num_output_tokens: int = 0,
        cache_salt: str | None = None,
    ) -> bool:
        """Adopt a request whose prompt another engine prefilled (the DE side of SPEC §2).

        Allocates device blocks for the prompt, lets ``fill_blocks(block_table)`` copy the
        prompt's KV into them, persists the prompt's full blocks beyond the first
        ``num_cached_tokens`` (already in the store), and continues decoding from
        ``first_token_id``. Returns False, changing nothing, when the blocks are not free now
        (the caller retries: back-pressure). A request that stops at its first token finishes
        at the next ``step``. The last ``num_output_tokens`` of ``prompt_token_ids`` are output
        sent before (a request going on after the loss of its DE): they count toward
        ``max_tokens``, ``min_tokens`` and stop strings as if this engine had made them. Its
        blocks are persisted in ``cache_salt``'s namespace, as the PE read them.
        """
        num_prompt_tokens = len(prompt_token_ids) - num_output_tokens
        prompt, outputs = prompt_token_ids[:num_prompt_tokens], prompt_token_ids[num_prompt_tokens:]
        self.validate_request(prompt, params)
        num_blocks = -(-len(prompt_token_ids) // self.block_size)
        reserve = len(self.running)  # one block per running sequence, as at admission
        if len(self.running) >= self.config.max_num_seqs or not self.pool.can_allocate(
            num_blocks + reserve
        ):
            return False
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            params=params,
            arrival_s=self.clock(),
            generator=make_generator(params),
            output_token_ids=list(outputs),
            status=SequenceStatus.RUNNING,
            block_table=self.pool.allocate(num_blocks),
            num_cached_tokens=num_cached_tokens,
            num_computed_tokens=len(prompt_token_ids),
            num_persisted_blocks=num_cached_tokens // self.block_size,
            is_admitted_once=True,
            cache_salt=cache_salt,
        )
        fill_blocks(seq.block_table)
        self.running.append(seq)
        self._persist_full_blocks(seq)
        output = self._append_token(seq, first_token_id, first_logprob, self.clock())
        self._new_tokens.pop(request_id, None)  # the prefill side streamed the first token
        self._new_logprobs.pop(request_id, None)
        if output is not None:
            self._finished_outside_step.append(output)
        return True

    def _persist_full_blocks(self, seq: Sequence) -> None:
        if self.store_io is None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_persisted_blocks:
            return
        seq.ensure_block_keys(num_full, self.block_size, self.fingerprint)
        for index in range(seq.num_persisted_blocks, num_full):
            self.store_io.persist(seq.block_keys[index], seq.block_table[index])
        seq.num_persisted_blocks = num_full

    def _banned_tokens(self, seq: Sequence) -> tuple[int, ...]:
        return banned_token_ids(seq.params, len(seq.output_token_ids), self.eos_token_ids)

    # --- lifecycle ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every full block computed so far is in the store."""
        if self.store_io is not None:
            self.store_io.flush()

    def close(self) -> None:
        if self.store_io is not None:
            self.store_io.close()
            self.store_io.store.close()
            self.store_io = None
