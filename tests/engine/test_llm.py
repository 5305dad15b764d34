"""The single-node engine: identical tokens whichever way the KV came, reuse across turns,
recovery from a damaged store, clear errors for bad input."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from dualpath import LLM, SamplingParams
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.hashing import block_keys
from tests.helpers import assert_same_tokens

BLOCK = 64
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model_dir: Path, prompts: list[list[int]], store: Path | None, params=PARAMS, **kw):
    with LLM(model_dir, kv_store=store, **kw) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def block_files(store: Path) -> list[Path]:
    return sorted(store.rglob("*.kvb"))


# Prompts ending mid-block and exactly on block boundaries.
PROMPT_LENGTHS = (1, 63, 64, 100, 128, 200)


def test_tokens_identical_cold_warm_and_without_store(
    each_architecture_dir: Path, tmp_path: Path
) -> None:
    prompts = [random_ids(n, seed=n) for n in PROMPT_LENGTHS]
    disabled = run(each_architecture_dir, prompts, None)
    cold = run(each_architecture_dir, prompts, tmp_path / "kv")
    warm = run(each_architecture_dir, prompts, tmp_path / "kv")
    for n, ref, c, w in zip(PROMPT_LENGTHS, disabled, cold, warm, strict=True):
        assert c.num_cached_tokens == 0
        # Every full block of the prompt was stored by the cold run; the last token is always
        # recomputed because its logits pick the next token.
        assert w.num_cached_tokens == min(BLOCK * (n // BLOCK), n - 1)
        assert_same_tokens(ref, c, label=f"cold store, prompt {n}")
        assert_same_tokens(ref, w, label=f"warm store, prompt {n}")


@pytest.mark.parametrize(("num_prompt", "num_output"), [(64, 1), (63, 2), (100, 28), (100, 29)])
def test_second_turn_reuses_prompt_and_output_blocks(
    tiny_model_dir: Path, tmp_path: Path, num_prompt: int, num_output: int
) -> None:
    store = tmp_path / "kv"
    params = SamplingParams(max_tokens=num_output, ignore_eos=True, logprobs=2)
    prompt = random_ids(num_prompt, seed=7)
    turn1 = run(tiny_model_dir, [prompt], store, params)[0]
    assert len(turn1.token_ids) == num_output
    turn2_prompt = prompt + turn1.token_ids + random_ids(30, seed=8)
    turn2 = run(tiny_model_dir, [turn2_prompt], store)[0]  # a separate engine, like a new process
    assert turn2.num_cached_tokens == BLOCK * ((num_prompt + num_output - 1) // BLOCK)
    assert_same_tokens(run(tiny_model_dir, [turn2_prompt], None)[0], turn2, label="turn 2")


def test_second_turn_through_text_is_mostly_cached(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    with LLM(tiny_model_dir, kv_store=store) as llm:
        text = "".join(
            f"$ grep -n item_{i} src/module_{i % 7}.py\n{i}: value = {i * 3}\n" for i in range(120)
        )
        turn1 = llm.generate(text, SamplingParams(max_tokens=16, ignore_eos=True))[0]
        turn2_text = text + turn1.text + "\n$ pytest -q\n3 passed in 0.12s\n"
        turn2 = llm.generate(turn2_text, SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert turn1.num_prompt_tokens > 1000
    assert turn2.num_cached_tokens >= 0.9 * turn2.num_prompt_tokens


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "empty", "delete"])
@pytest.mark.parametrize("which", [0, 2, -1])
def test_damaged_block_is_recomputed(
    tiny_model_dir: Path, tmp_path: Path, damage: str, which: int
) -> None:
    store = tmp_path / "kv"
    prompt = random_ids(5 * BLOCK + 10, seed=11)
    reference = run(tiny_model_dir, [prompt], store)[0]
    files_by_block = _prompt_block_files(tiny_model_dir, store, prompt)
    victim = files_by_block[which]
    data = victim.read_bytes()
    if damage == "flip_payload":
        victim.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
    elif damage == "flip_header":
        victim.write_bytes(data[:6] + bytes([data[6] ^ 0xFF]) + data[7:])
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        victim.write_bytes(b"")
    else:
        victim.unlink()
    again = run(tiny_model_dir, [prompt], store)[0]
    index = which % len(files_by_block)
    assert again.num_cached_tokens == BLOCK * index
    assert_same_tokens(reference, again, label=f"{damage} block {index}")
    # The damaged block was dropped and, recomputed, written again intact.
    assert victim.read_bytes() == data


def _prompt_block_files(model_dir: Path, store: Path, prompt: list[int]) -> list[Path]:
    from dualpath.kv.hashing import block_keys

    with LLM(model_dir, kv_store=store) as llm:
        fingerprint = llm.engine.fingerprint
    keys = block_keys(prompt, BLOCK, fingerprint)
    files = {path.stem: path for path in block_files(store)}
    return [files[key] for key in keys]


def test_store_capacity_evicts_but_tokens_stay_right(tiny_model_dir: Path, tmp_path: Path) -> None:
    with LLM(tiny_model_dir) as probe:
        block_bytes = probe.engine.cache.layout.full_block_bytes
    store = tmp_path / "kv"
    prompts = [random_ids(3 * BLOCK, seed=s) for s in (1, 2)]
    capacity = 4 * (block_bytes + 4096)  # room for about four blocks with headers
    first = run(tiny_model_dir, prompts, store, kv_store_capacity_bytes=capacity)
    again = run(tiny_model_dir, prompts, store, kv_store_capacity_bytes=capacity)
    assert sum(f.stat().st_size for f in block_files(store)) <= capacity
    for a, b in zip(first, again, strict=True):
        assert_same_tokens(a, b, label="after eviction")


def test_chunked_prefill_preemption_and_batching_keep_tokens(
    each_architecture_dir: Path, tmp_path: Path
) -> None:
    model_dir = each_architecture_dir
    prompts = [random_ids(n, seed=100 + n) for n in (60, 61, 62, 150)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    alone = [run(model_dir, [p], None, params)[0] for p in prompts]
    batched = run(model_dir, prompts, None, params)
    chunked = run(model_dir, prompts, None, params, max_num_batched_tokens=48)
    # Three short prompts fit in 5 blocks but all grow past 64 tokens at the same step: the
    # newest is preempted and recomputed (its stored blocks hit).
    with LLM(model_dir, kv_store=tmp_path / "kv", num_device_blocks=5) as llm:
        squeezed = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.pool.num_free_blocks == 5
    assert sum(o.num_preemptions for o in squeezed) > 0
    for ref, b, c, s in zip(alone, batched, chunked, squeezed, strict=True):
        assert_same_tokens(ref, b, label="batched")
        assert_same_tokens(ref, c, label="chunked prefill")
        assert_same_tokens(ref, s, label="preempted")


def test_seeded_sampling_is_reproducible(tiny_model_dir: Path) -> None:
    prompt = {"prompt_token_ids": random_ids(20, seed=3)}
    with LLM(tiny_model_dir) as llm:
        a, b, c = (
            llm.generate(prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=s))[0]
            for s in (5, 5, 6)
        )
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_rules(tiny_model_dir: Path) -> None:
    prompt = {"prompt_token_ids": random_ids(20, seed=4)}
    with LLM(tiny_model_dir) as llm:
        free = llm.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))[0]
        stop_id = free.token_ids[5]
        first = free.token_ids.index(stop_id)
        by_id = llm.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop_id,)))[0]
        at_least = llm.generate(
            prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop_id,), min_tokens=first + 2)
        )[0]
        stop_text = llm.tokenizer.decode(free.token_ids[8:10])
        by_text = llm.generate(prompt, SamplingParams(max_tokens=30, stop=(stop_text,)))[0]
    assert by_id.token_ids == free.token_ids[: first + 1] and by_id.finish_reason == "stop"
    assert len(at_least.token_ids) > first + 1
    assert by_text.finish_reason == "stop" and stop_text not in by_text.text
    assert free.text.startswith(by_text.text)
    assert free.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([5, 1024], SamplingParams(), "outside the vocabulary"),
        ([5, -1], SamplingParams(), "outside the vocabulary"),
        (list(range(1000)) * 17, SamplingParams(), "longer than the model's context"),
        ([1] * 16000, SamplingParams(max_tokens=1000), "exceeds the model's context"),
    ],
)
def test_bad_requests_are_refused(tiny_model_dir: Path, prompt, params, message: str) -> None:
    with LLM(tiny_model_dir) as llm:
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_token_ids": prompt}, params)
        assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_store_namespace_separates_block_sizes(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompt = random_ids(3 * BLOCK, seed=21)
    store = tmp_path / "kv"
    run(tiny_model_dir, [prompt], store)
    other = run(tiny_model_dir, [prompt], store, block_size=32)[0]
    assert other.num_cached_tokens == 0
    assert len([d for d in store.iterdir() if d.is_dir()]) == 2
    with LLM(tiny_model_dir, kv_store=store) as llm:
        assert isinstance(llm.engine.store_io.store, FileKVStore)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_reuses_its_own_namespace(
    tiny_model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    store = tmp_path / "kv"
    prompt = random_ids(2 * BLOCK + 5, seed=31)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    run(tiny_model_dir, [prompt], store, params)  # float32 blocks
    cold = run(tiny_model_dir, [prompt], store, params, dtype=dtype)[0]
    warm = run(tiny_model_dir, [prompt], store, params, dtype=dtype)[0]
    assert cold.num_cached_tokens == 0  # float32 KV is never served to a half-precision engine
    assert warm.num_cached_tokens == 2 * BLOCK
    assert len(warm.token_ids) == 8
    with LLM(tiny_model_dir, dtype=dtype) as llm:
        assert llm.engine.cache.layout.bytes_per_token_per_layer == 2 * 2 * 32 * 2


def test_a_finished_request_names_the_blocks_still_being_written(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with LLM(tiny_model_dir, kv_store=tmp_path / "kv") as llm:
        store_io = llm.engine.store_io
        gate = threading.Event()
        write = store_io.store.write

        def held_write(key, data):
            # However long the generation takes: a write that gave up would be lost.
            assert gate.wait(120.0), "test bug: the store was never released"
            return write(key, data)

        store_io.store.write = held_write
        prompt = random_ids(150, seed=3)  # 2 full blocks, then 1 more filled by the output
        llm.engine.add_request(prompt, SamplingParams(max_tokens=60, ignore_eos=True))
        outputs = []
        while llm.engine.has_unfinished_requests():
            outputs += llm.engine.step()
        (out,) = outputs
        keys = out.written_block_keys
        assert len(keys) == (150 + 60 - 1) // BLOCK == 3
        assert store_io.pending(keys) == keys  # none written while the store is held
        assert store_io.store.lookup(keys) == 0
        gate.set()
        llm.engine.flush()
        assert store_io.pending(keys) == ()
        assert store_io.store.lookup(keys) == 3


def test_a_prompts_cache_salt_keeps_its_blocks_to_itself(tiny_model_dir: Path, tmp_path: Path):
    """As vLLM's prompts do, ``{"prompt_token_ids": ..., "cache_salt": ...}`` looks up and
    persists the prompt's blocks in the salt's namespace: another salt, or none, finds none
    of them; the same salt finds them all, under the keys ``kv.hashing`` derives for it."""
    prompt = random_ids(200, seed=12)
    with LLM(tiny_model_dir, kv_store=tmp_path / "kv") as llm:

        def run(cache_salt: str | None):
            salted = {} if cache_salt is None else {"cache_salt": cache_salt}
            return llm.generate({"prompt_token_ids": prompt, **salted}, PARAMS)[0]

        first = run("tenant-a")
        others = [run("tenant-b"), run(None)]
        again = run("tenant-a")
        fingerprint = llm.engine.fingerprint
        store = llm.engine.store_io.store
        salted_keys = block_keys(prompt, BLOCK, fingerprint, cache_salt="tenant-a")
        assert store.lookup(salted_keys) == len(salted_keys) == 3
        with pytest.raises(ValueError, match="cache_salt"):
            run("a/b")
    assert [o.num_cached_tokens for o in (first, *others)] == [0, 0, 0]
    assert again.num_cached_tokens == 3 * BLOCK
    for out in (*others, again):
        assert_same_tokens(first, out, label="another salt")
