"""How a request finishes in an engine: why its sequence stops at a token
(``finish_reason``) and the ``RequestOutput`` it returns (``request_output``).

``LLMEngine`` (``llm_engine.py``) calls both after each sampled token; ``RequestOutput`` is
also what the offline ``LLM`` API (``llm.py``) and vLLM's adapter (``dualpath.vllm.llm``)
hand back, so it lives here, below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.engine.sampling import TokenLogprob, token_finish_reason
from dualpath.engine.sequence import Sequence
from dualpath.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request: generated tokens, how much of the prompt came from the store, and
    timings in seconds on the engine's clock."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    # Prompt tokens whose KV was loaded from the store instead of computed.
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None
    arrival_s: float
    first_token_s: float | None
    finish_s: float
    load_s: float  # reading hit blocks from the store
    num_preemptions: int
    # Keys of the full blocks this request queued for persisting (those beyond its cached
    # prefix), in chain order: with ``KVStoreIO.pending`` they say what the store lacks yet.
    written_block_keys: tuple[str, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


def finish_reason(
    seq: Sequence,
    token_id: int,
    eos_token_ids: tuple[int, ...],
    tokenizer: Tokenizer,
    max_model_len: int,
) -> str | None:
    """Why ``seq`` ends at ``token_id`` (just appended), if it does: what ends it on any
    engine (``token_finish_reason``), then a stop string (its match sets
    ``seq.stop_text_end``), then the context of ``max_model_len`` tokens."""
    params = seq.params
    reason = token_finish_reason(params, token_id, len(seq.output_token_ids) - 1, eos_token_ids)
    if reason == "stop":
        return "stop"
    if params.stop:
        text = tokenizer.decode(seq.output_token_ids)
        ends = [text.find(s) for s in params.stop if s in text]
        if ends:
            seq.stop_text_end = min(ends)
            return "stop"
    if reason == "length" or seq.num_tokens >= max_model_len:
        return "length"
    return None


def request_output(seq: Sequence, tokenizer: Tokenizer, block_size: int) -> RequestOutput:
    """The output of finished ``seq``: its text cut at the stop string that ended it, and
    the keys of the blocks it persisted beyond its cached prefix (``block_size`` tokens)."""
    text = tokenizer.decode(seq.output_token_ids)
    if seq.stop_text_end is not None:
        text = text[: seq.stop_text_end]
    assert seq.finish_reason is not None and seq.finish_s is not None, "finished seq"
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        text=text,
        finish_reason=seq.finish_reason,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
        arrival_s=seq.arrival_s,
        first_token_s=seq.first_token_s,
        finish_s=seq.finish_s,
        load_s=seq.load_s,
        num_preemptions=seq.num_preemptions,
        written_block_keys=tuple(
            seq.block_keys[seq.num_cached_tokens // block_size : seq.num_persisted_blocks]
        ),
    )
