"""``--kv-transfer-config`` JSON printed before the connector moved to ``dualpath.vllm.served``
names its old module path, ``dualpath.cluster.served``: vLLM imports the connector by that
string, and it must still be the same class."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.vllm


def test_the_old_connector_module_path_loads_the_same_connector() -> None:
    old = importlib.import_module("dualpath.cluster.served")
    new = importlib.import_module("dualpath.vllm.served")
    assert old.DualpathServedConnector is new.DualpathServedConnector
