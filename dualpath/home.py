"""The data directory: where the default models, the KV store, the stored responses of the
API and the servers' logs live.

It is ``$DUALPATH_HOME``, or ``~/.cache/dualpath`` when that is unset. The command line and
the benchmarks share these defaults, so they are here, below both.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PRESET = "tiny"  # the random-weight preset of make-model and the benchmarks


def data_home() -> Path:
    return Path(os.environ.get("DUALPATH_HOME") or Path.home() / ".cache" / "dualpath")


def models_dir() -> Path:
    return data_home() / "models"


def tiny_model_dir() -> Path:
    return models_dir() / DEFAULT_PRESET


def default_kv_store_dir() -> Path:
    return data_home() / "kv"


def default_responses_dir() -> Path:
    """Where ``dualpath serve`` keeps the responses of /v1/responses."""
    return data_home() / "responses"
