"""The offline Python API: ``LLM``, batch inference on one engine (the shape of ``vllm.LLM``),
and the prompts it takes.

    from dualpath import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", kv_store="path/to/kv")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16))[0]
    print(out.text, out.num_cached_tokens)

The engine it drives, its step loop and the store underneath, is ``LLMEngine``
(``llm_engine.py``); the ``RequestOutput`` it returns is in ``output.py``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from dualpath.config import EngineConfig, KVStoreConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.output import RequestOutput
from dualpath.engine.sampling import SamplingParams
from dualpath.model.loader import load_model
from dualpath.types import check_cache_salt

Prompt = str | Seq[int] | dict[str, Any]


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's token ids: text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids":
    [...]}`` (``tokenizer``: ours, its ``encode``); a dict may name its ``cache_salt``, as
    vLLM's prompts do (``prompt_cache_salt``)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return list(prompt)


def prompt_cache_salt(prompt: Prompt) -> str | None:
    """The tenant namespace a prompt dict names (vLLM's ``cache_salt``), None for any other
    prompt; ``ValueError`` for a salt vLLM would refuse."""
    cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    check_cache_salt(cache_salt)
    return cache_salt


class LLM:
    """Offline batch inference on one engine (the shape of ``vllm.LLM``)."""

    def __init__(
        self,
        model: str | Path,
        *,
        kv_store: str | Path | None = None,
        kv_store_capacity_bytes: int | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        block_size: int = 64,
        num_device_blocks: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        num_threads: int | None = None,
    ) -> None:
        engine_config = EngineConfig(
            num_threads=num_threads,
            block_size_tokens=block_size,
            device=device,
            dtype=dtype or "float32",
            num_device_blocks=num_device_blocks,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        store_config = KVStoreConfig(
            root_dir=None if kv_store is None else Path(kv_store),
            capacity_bytes=kv_store_capacity_bytes,
        )
        loaded = load_model(Path(model), device=device, dtype=dtype)
        self.tokenizer = loaded.tokenizer
        self.engine = LLMEngine(loaded, engine_config, store_config)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or ``{"prompt_token_ids": [...]}``, with
        a ``"cache_salt"`` for a tenant's namespace of the store) and return outputs in prompt
        order, after their blocks are persisted."""
        if isinstance(prompts, (str, dict)) or (
            prompts and isinstance(prompts, Seq) and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        params_list = (
            [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params given for {len(prompts)} prompts")
        token_prompts = [self.encode_prompt(p) for p in prompts]
        salts = [prompt_cache_salt(p) for p in prompts]
        for tokens, p in zip(token_prompts, params_list, strict=True):
            self.engine.validate_request(tokens, p)  # all or nothing: nothing queued on error
        request_ids = [
            self.engine.add_request(tokens, p, cache_salt=salt)
            for tokens, p, salt in zip(token_prompts, params_list, salts, strict=True)
        ]
        outputs: dict[int, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="generate", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    outputs[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        self.engine.flush()
        return [outputs[request_id] for request_id in request_ids]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
