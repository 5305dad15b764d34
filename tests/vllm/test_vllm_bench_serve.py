"""vLLM's own client benchmark, `vllm bench serve` (scripts/vllm_bench_serve.py), against
`dualpath serve` on our engine and on vLLM's (1P1D, the generated tiny checkpoint): its random
dataset, over /v1/completions (backend openai) and /v1/chat/completions (openai-chat),
streamed with usage.
Every request completes, none fails, vLLM's prompt alignment through our /tokenize works, and
/metrics counted exactly the requests and tokens vLLM's result JSON reports, under our names
and vLLM's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.serving import MODEL, Server, http_count, metric_values, start_server

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).parents[2] / "scripts" / "vllm_bench_serve.py"
NUM_PROMPTS = 8
INPUT_LEN = 32
OUTPUT_LEN = 8
BENCH_TIMEOUT_S = 300  # a hang guard: about 20 s on 2 cores, most of it importing vLLM
VLLM_LABELS = (("engine", "0"), ("model_name", MODEL))


ENGINE_ARGS = {"ours": (), "vllm": ("--engine", "vllm", "--max-model-len", "2048")}


@pytest.fixture(scope="module", params=list(ENGINE_ARGS))
def server(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp(f"bench-serve-{request.param}")
    args = ("--nodes", "1P1D", *ENGINE_ARGS[request.param])
    # No API key: vLLM's bench sends none to /tokenize (vLLM serves it without one).
    with start_server(tiny_model_dir, root, *args, has_api_key=False) as started:
        yield started


def run_vllm_bench(
    server: Server, tokenizer_dir: Path, out_dir: Path, backend: str, endpoint: str
) -> tuple[dict, str]:
    """vLLM's result JSON and the benchmark's output."""
    argv = [
        sys.executable, str(SCRIPT),
        "--backend", backend, "--endpoint", endpoint,
        "--base-url", server.url, "--model", MODEL, "--tokenizer", str(tokenizer_dir),
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
        "--ignore-eos", "--seed", "0", "--disable-tqdm",
        # Exactly NUM_PROMPTS requests: no test request first, no warm-up.
        "--ready-check-timeout-sec", "0", "--num-warmups", "0",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", "result.json",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, env=env, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return json.loads((out_dir / "result.json").read_text()), output


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_completes_every_request(
    server: Server, tiny_model_dir: Path, tmp_path: Path, backend: str, endpoint: str
) -> None:
    before = metric_values(server)
    result, output = run_vllm_bench(server, tiny_model_dir, tmp_path, backend, endpoint)
    assert result["failed"] == 0 and result["completed"] == NUM_PROMPTS, output[-3000:]
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # --ignore-eos
    assert "/tokenize unavailable" not in output, output[-3000:]
    after = metric_values(server)

    def grown(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert http_count(after, endpoint, 200) - http_count(before, endpoint, 200) == NUM_PROMPTS
    # vLLM's token totals are our usage figures, streamed: /metrics counted the same.
    for ours, theirs, value in (
        ("dualpath_prompt_tokens_total", "vllm:prompt_tokens_total", "total_input_tokens"),
        ("dualpath_generation_tokens_total", "vllm:generation_tokens_total", "total_output_tokens"),
    ):
        assert grown(ours) == grown(theirs, VLLM_LABELS) == result[value], ours
    length = (("finish_reason", "length"),)
    vllm_length = tuple(sorted((*VLLM_LABELS, ("finished_reason", "length"))))
    assert grown("dualpath_generations_total", length) == NUM_PROMPTS
    assert grown("vllm:request_success_total", vllm_length) == NUM_PROMPTS
    assert grown("vllm:time_to_first_token_seconds_count", VLLM_LABELS) == NUM_PROMPTS
    assert grown("vllm:inter_token_latency_seconds_count", VLLM_LABELS) >= NUM_PROMPTS
