"""Text <-> token ids through a checkpoint's ``tokenizer.json`` (the ``tokenizers`` library), and
the checkpoint's chat templates as transformers finds them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from dualpath.errors import CheckpointError


class Tokenizer:
    """Encodes without adding special tokens (prompts are sent whole); decodes skipping none."""

    def __init__(self, path: Path) -> None:
        try:
            self._tokenizer = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise CheckpointError(f"{path}: cannot load tokenizer: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ``ValueError`` for text that is not Unicode scalar values
        (a lone surrogate such as "\\ud800", which JSON can carry and UTF-8 cannot)."""
        try:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError as exc:
            bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
            where = "" if bad is None else f" (a lone surrogate at character {bad})"
            raise ValueError(f"text cannot be tokenized: it is not valid Unicode{where}") from exc

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.50 saves the template here
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # and more named ones as NAME.jinja here
DEFAULT_TEMPLATE_NAME = "default"


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's ``tokenizer_config.json`` ({} if it has none)."""
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be parsed as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def read_chat_templates(model_dir: Path) -> dict[str, str]:
    """The checkpoint's chat templates by name ("default", "tool_use", ...), as transformers
    reads them: from ``chat_template.jinja`` (the default one) and
    ``additional_chat_templates/NAME.jinja``, the files transformers >= 5 saves; if there are
    none, from ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
    templates). {} if the checkpoint has no template."""
    model_dir = Path(model_dir)
    files = [(DEFAULT_TEMPLATE_NAME, model_dir / CHAT_TEMPLATE_FILE)]
    files += [(p.stem, p) for p in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja"))]
    templates: dict[str, str] = {}
    for name, path in files:
        try:
            templates[name] = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot be read: {exc}") from exc
    if templates:  # as in transformers, the files replace the config's templates
        return templates
    raw = read_tokenizer_config(model_dir).get("chat_template")
    if isinstance(raw, str):
        templates[DEFAULT_TEMPLATE_NAME] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name"))] = entry["template"]
    return templates
