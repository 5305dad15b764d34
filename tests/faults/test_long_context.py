"""The embedded default (SmolLM2-135M-Instruct, float32, 8,192-token context) served at its
default buffer sizes: prompts of 8,191 tokens, and of 8,128 generating to the limit, through
`dualpath serve` 1P2D on every read path, cold and warm, with the single-node engine's tokens
(``tests/server/test_long_context.py`` runs the same on the tiny model in `make test`). Here
rather than in `make test` for its minutes of prefill on two cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.test_long_context import reference_outputs, serve_whole_context

CONTEXT = 8192


@pytest.fixture(scope="module")
def references(smollm2_model_dir: Path) -> list:
    return reference_outputs(smollm2_model_dir, CONTEXT)


@pytest.mark.parametrize("read_path", ["pe", "de", "split"])
def test_the_default_model_serves_its_whole_context_on_every_read_path(
    read_path: str, smollm2_model_dir: Path, references: list, tmp_path: Path
) -> None:
    serve_whole_context(smollm2_model_dir, tmp_path, read_path, CONTEXT, references)
