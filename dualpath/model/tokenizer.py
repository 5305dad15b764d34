"""Text <-> token ids through a checkpoint's ``tokenizer.json`` (the ``tokenizers`` library)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from dualpath.errors import CheckpointError


class Tokenizer:
    """Encodes without adding special tokens (prompts are sent whole); decodes skipping none."""

    def __init__(self, path: Path) -> None:
        try:
            self._tokenizer = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise CheckpointError(f"{path}: cannot load tokenizer: {exc}") from exc
        self.chat_template = _read_chat_template(path.parent / "tokenizer_config.json")

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


def _read_chat_template(path: Path) -> str | None:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be parsed as JSON: {exc}") from exc
    template = raw.get("chat_template") if isinstance(raw, dict) else None
    return template if isinstance(template, str) else None
