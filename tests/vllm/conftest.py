"""The vLLM tests' shared engines: plain vLLM's reference engine, started once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.reference import PlainVllm


@pytest.fixture(scope="session")
def plain_vllm(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PlainVllm]:
    """Plain vLLM (its own ``LLM``, no connector, no prefix cache) on the embedded checkpoint."""
    engine = PlainVllm(smollm2_model_dir, tmp_path_factory.mktemp("reference") / "vllm.log")
    try:
        yield engine
    finally:
        engine.close()
