"""The longest requests the model accepts, through `dualpath serve` (1P2D) at its default buffer
sizes: a prompt of context - 1 tokens, and one of context - 64 that generates up to the limit,
are served on the PE, DE and split read paths, cold and warm (hits read from the store), with
the single-node engine's tokens. A buffer too small for one of them is refused at start.

In `make test` the context is cut to 2,048 tokens (``--max-model-len``) so that the tiny model
prefills it fast; buffers are sized from it exactly as from SmolLM2's 8,192 (two whole-context
requests), so a request is the same share of its buffer as there. The embedded default at its
whole 8,192-token context runs the same (``slow``: eight whole-context prefills, about 15
minutes on two cores): ``pytest -m slow tests/server/test_long_context.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dualpath.engine.llm import LLM
from dualpath.types import SamplingParams
from tests.helpers import assert_same_tokens
from tests.server.serving import MODEL, Server, random_ids, start_server

CONTEXT = 2048
BLOCK = 64
PREFILL_TIMEOUT_S = 900


def whole_context_requests(context: int) -> tuple[tuple[int, int], ...]:
    """(prompt tokens, tokens generated): the longest prompt, and one generating to the
    limit."""
    return ((context - 1, 1), (context - 64, 64))


def reference_outputs(model_dir: Path, context: int) -> list:
    """The single-node engine's greedy tokens (with top-2 logprobs) for each request."""
    with LLM(model_dir, max_model_len=context) as llm:
        return [
            llm.generate(
                _prompt(num_prompt),
                SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True, logprobs=2),
            )[0]
            for num_prompt, num_new in whole_context_requests(context)
        ]


def serve_whole_context(
    model_dir: Path, root: Path, read_path: str, context: int, references: list
) -> None:
    """`dualpath serve` 1P2D at its default buffers on ``read_path``: each whole-context
    request cold (streamed: a failure would come after the 200), then warm (its whole blocks
    read from the store), with ``references``' tokens."""
    args = ("--nodes", "1P2D", "--max-model-len", str(context), "--read-path", read_path)
    with start_server(model_dir, root, *args) as server:
        for is_warm in (False, True):
            for (num_prompt, num_new), reference in zip(
                whole_context_requests(context), references, strict=True
            ):
                token_ids, cached = _complete(
                    server, _prompt(num_prompt), num_new, stream=not is_warm
                )
                label = f"{read_path} {'warm' if is_warm else 'cold'} prompt {num_prompt}"
                assert len(token_ids) == num_new, label
                assert_same_tokens(reference, SimpleNamespace(token_ids=token_ids), label=label)
                assert cached == ((num_prompt - 1) // BLOCK * BLOCK if is_warm else 0), label


def _prompt(num_tokens: int) -> list[int]:
    return random_ids(num_tokens, seed=num_tokens)


def _complete(server: Server, prompt: list[int], max_tokens: int, *, stream: bool):
    """(token ids, cached tokens) of a greedy completion."""
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    # A whole-context prefill of the real model takes minutes on a loaded 2-core machine.
    client = server.client.with_options(timeout=PREFILL_TIMEOUT_S)
    if not stream:
        out = client.completions.create(**kwargs, extra_body=extra)
        return out.choices[0].token_ids, out.usage.prompt_tokens_details.cached_tokens
    token_ids, cached = [], None
    chunks = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=extra
    )
    for chunk in chunks:
        if chunk.choices:
            token_ids += chunk.choices[0].token_ids
        else:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return token_ids, cached


READ_PATHS = ["pe", "de", "split"]
DEFAULT_MODEL_CONTEXT = 8192  # SmolLM2-135M-Instruct's


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> list:
    return reference_outputs(tiny_model_dir, CONTEXT)


@pytest.mark.parametrize("read_path", READ_PATHS)
def test_whole_context_requests_are_served_on_every_read_path(
    read_path: str, tiny_model_dir: Path, references: list, tmp_path: Path
) -> None:
    serve_whole_context(tiny_model_dir, tmp_path, read_path, CONTEXT, references)


@pytest.fixture(scope="module")
def default_model_references(smollm2_model_dir: Path) -> list:
    return reference_outputs(smollm2_model_dir, DEFAULT_MODEL_CONTEXT)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("read_path", READ_PATHS)
def test_the_default_model_serves_its_whole_context_on_every_read_path(
    read_path: str, smollm2_model_dir: Path, default_model_references: list, tmp_path: Path
) -> None:
    serve_whole_context(
        smollm2_model_dir, tmp_path, read_path, DEFAULT_MODEL_CONTEXT, default_model_references
    )


def _refused(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dualpath.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={"DUALPATH_HOME": str(tmp_path), "DUALPATH_CLUSTER_TOKEN": "t", "PATH": "/usr/bin"},
    )


def test_a_buffer_too_small_for_one_request_is_refused_at_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Both `serve` and `engine` exit 2 before starting anything, naming the flag and the size
    one request of the context needs (the tiny model: 32 Full Blocks of 131,072 bytes)."""
    small = ("--buffer-gb", "0.002", "--max-model-len", str(CONTEXT))
    serve = _refused(["serve", "--model", str(tiny_model_dir), "--port", "0", *small], tmp_path)
    engine = _refused(
        [
            "engine", "--model", str(tiny_model_dir), "--role", "decode",
            "--scheduler", "tcp://127.0.0.1:9", "--engine-id", "1", "--node-id", "1", *small,
        ],
        tmp_path,
    )  # fmt: skip
    for result in (serve, engine):
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert "--buffer-gb" in result.stderr, result.stderr
        assert "needs 32 (0.005 GB)" in result.stderr, result.stderr
