"""The workload package is torch-free (STYLE.md §4), so its tests skip the root conftest's torch
setup: importing torch alone would cost more than all these tests together."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _deterministic_torch() -> None:
    """Overrides the root fixture of the same name for tests/workload only: no torch here."""
