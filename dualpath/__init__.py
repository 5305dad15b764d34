"""dualpath: disaggregated LLM serving for agentic, multi-turn workloads.

``from dualpath import LLM, SamplingParams`` gives the single-node engine. Those names are
imported lazily so that torch-free parts (``dualpath.scheduler``, ``dualpath.kv`` metadata,
``dualpath.sim``) can be imported without pulling in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dualpath import compiled as _compiled

_compiled.install()  # loads the optional compiled simulator when it is fresh (compiled.py)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]

if TYPE_CHECKING:
    from dualpath.engine.llm import LLM
    from dualpath.engine.output import RequestOutput
    from dualpath.types import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from dualpath.engine.llm import LLM

        return LLM
    if name == "RequestOutput":
        from dualpath.engine.output import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from dualpath.types import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dualpath' has no attribute {name!r}")
