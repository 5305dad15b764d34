"""The engines' KV memory a calibrated preset gives vLLM engines (``presets.engine_kv_cache_gb``,
``offline.engines_kv_cache_gb``): a fraction of the agents' final contexts' KV, at least one
request of the model's context, raised to the next whole MB; ``--kv-cache-gb`` wins, and the
native engine keeps serve's default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dualpath.bench.offline import engines_kv_cache_gb
from dualpath.bench.presets import PRESETS, engine_kv_cache_gb, final_context_tokens
from dualpath.units import gb_to_bytes
from dualpath.workload import Workload
from dualpath.workload.types import Session, Turn

TINY_KV_BYTES_PER_TOKEN = 2048  # 4 layers x (64 + 64) float32 values
TINY_CONTEXT_BYTES = 16_384 * TINY_KV_BYTES_PER_TOKEN  # 256 blocks of 64 tokens


def _turn(num_append_tokens: int, output_tokens: int) -> Turn:
    return Turn(np.arange(num_append_tokens, dtype=np.int32) % 100, output_tokens)


def _workload(*sessions: list[tuple[int, int]]) -> Workload:
    return Workload(
        [
            Session(f"s{i}", 0.0, tuple(_turn(*turn) for turn in turns))
            for i, turns in enumerate(sessions)
        ],
        "test",
    )


# s0: prompts 100, then 100 + 10 + 50 = 160, final context 160 + 5 = 165; s1: 30 + 2 = 32.
SMALL = _workload([(100, 10), (50, 5)], [(30, 2)])


def test_final_contexts_are_each_sessions_last_prompt_and_output() -> None:
    assert final_context_tokens(SMALL) == 165 + 32


def test_the_size_is_the_fraction_of_the_final_contexts_kv_raised_to_the_next_mb() -> None:
    # 0.2 x 197 tokens x 1 MB = 39.4 MB -> 40 MB.
    assert engine_kv_cache_gb(SMALL, fraction=0.2, kv_bytes_per_token=1e6, min_bytes=0) == 0.040
    # Exactly 197 MB still goes up a MB: no float rounding of the GB takes a byte off.
    assert engine_kv_cache_gb(SMALL, fraction=1.0, kv_bytes_per_token=1e6, min_bytes=0) == 0.198


def test_the_size_is_at_least_one_request_of_the_whole_context() -> None:
    size_gb = engine_kv_cache_gb(
        SMALL,
        fraction=0.2,
        kv_bytes_per_token=TINY_KV_BYTES_PER_TOKEN,
        min_bytes=TINY_CONTEXT_BYTES,
    )
    assert size_gb == 0.034  # 33,554,432 B -> 34 MB
    assert gb_to_bytes(size_gb) >= TINY_CONTEXT_BYTES


def test_vllm_engines_get_the_calibrated_presets_rule(tiny_model_dir: Path) -> None:
    # One session of 100,000 + 10 tokens: a fifth of its KV is 40,964,096 B -> 41 MB.
    large = _workload([(100_000, 10)])
    for name in ("paper-ratio", "agentic"):
        assert engines_kv_cache_gb(
            PRESETS[name], large, tiny_model_dir, engine="vllm", kv_cache_gb=None
        ) == (0.041, "preset rule")
    # Below one request of the tiny model's 16K context: that much.
    assert engines_kv_cache_gb(
        PRESETS["paper-ratio"], SMALL, tiny_model_dir, engine="vllm", kv_cache_gb=None
    ) == (0.034, "preset rule")


@pytest.mark.parametrize(
    ("preset", "engine", "kv_cache_gb", "expected"),
    [
        ("paper-ratio", "vllm", 0.5, (0.5, "flag")),  # the flag wins
        ("paper-ratio", "native", 0.5, (0.5, "flag")),
        ("paper-ratio", "native", None, (None, None)),  # native: serve's default
        ("ci", "vllm", None, (None, None)),  # a preset without the rule: serve's default
    ],
)
def test_the_flag_wins_and_otherwise_serve_decides(
    tiny_model_dir: Path,
    preset: str,
    engine: str,
    kv_cache_gb: float | None,
    expected: tuple[float | None, str | None],
) -> None:
    assert (
        engines_kv_cache_gb(
            PRESETS[preset], SMALL, tiny_model_dir, engine=engine, kv_cache_gb=kv_cache_gb
        )
        == expected
    )
