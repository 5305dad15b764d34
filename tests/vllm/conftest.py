"""The vLLM tests' shared engines: plain vLLM's reference engine, started once per session, at
its first test if any test of the session asks for it."""

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


@pytest.fixture(scope="session", autouse=True)
def _plain_vllm_loads_from_the_start(request: pytest.FixtureRequest) -> None:
    """The reference engine's process loads (about 20 s, mostly one core) beside the tests that
    come before its first user (the connector's in-process engine, the CLI runs), instead of
    in front of that user; a session none of whose tests asks for it never starts it."""
    if any("plain_vllm" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("plain_vllm")
