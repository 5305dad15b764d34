"""The architectures dualpath serves: a checkpoint's ``architectures[0]`` -> its config class.

Each config class reads its own ``config.json`` (refusing by name what it does not implement)
and says what one token caches in one layer (``kv_bytes_per_token_per_layer``), without torch:
the scheduler process sizes the store's Full Blocks from it. The model class of each config is
the loader's business (``loader.MODEL_CLASSES``). Adding an architecture is a config class, a
model class (``layerwise.LayerwiseModel``) and one entry in each table.

    config = read_config(checkpoint_dir / "config.json")   # ModelConfig | DeepseekConfig
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dualpath.errors import CheckpointError
from dualpath.model import config as dense
from dualpath.model import deepseek_config as deepseek
from dualpath.model.config import ModelConfig, read_json_object, with_generation_config_eos
from dualpath.model.deepseek_config import DeepseekConfig

AnyModelConfig = ModelConfig | DeepseekConfig

CONFIG_CLASSES: dict[str, type[ModelConfig] | type[DeepseekConfig]] = {
    **dict.fromkeys(dense.SUPPORTED_ARCHITECTURES, ModelConfig),
    **dict.fromkeys(deepseek.SUPPORTED_ARCHITECTURES, DeepseekConfig),
}


def config_class(raw: dict[str, Any], where: str) -> type[ModelConfig] | type[DeepseekConfig]:
    architectures = raw.get("architectures") or []
    name = architectures[0] if architectures else None
    cls = CONFIG_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CheckpointError(
            f"{where}: architecture {name!r} is not supported; supported: "
            f"{', '.join(sorted(CONFIG_CLASSES))}"
        )
    return cls


def config_from_dict(raw: dict[str, Any]) -> AnyModelConfig:
    return config_class(raw, "config").from_dict(raw)


def read_config(path: Path) -> AnyModelConfig:
    """The architecture of the checkpoint whose ``config.json`` is at ``path``."""
    raw = read_json_object(Path(path))  # read once: the class it names parses it
    config = config_class(raw, str(path)).from_dict(raw)
    return with_generation_config_eos(config, Path(path))
