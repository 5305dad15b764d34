"""``make-model --tokenizer-from`` and ``--max-position-embeddings``: a random-weight checkpoint
with a real model's tokenizer and a long context (what agent harnesses' prompts need)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.model.make import make_model
from dualpath.model.tokenizer import Tokenizer


def test_a_real_tokenizer_and_a_long_context(smollm2_model_dir: Path, tmp_path: Path) -> None:
    out = make_model(
        "tiny",
        tmp_path / "agent",
        tokenizer_from=smollm2_model_dir,
        max_position_embeddings=65536,
    )
    config = json.loads((out / "config.json").read_text())
    real = Tokenizer(smollm2_model_dir / "tokenizer.json")
    made = Tokenizer(out / "tokenizer.json")
    assert config["max_position_embeddings"] == 65536
    assert config["vocab_size"] == real.vocab_size == 49152
    text = "def main():\n    print('hello, agents')  # ünïcode"
    assert made.encode(text) == real.encode(text)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 65536


def test_a_tokenizer_without_chatml_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer_dir = tmp_path / "plain"
    tokenizer_dir.mkdir()
    vocab = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    vocab["added_tokens"] = [t for t in vocab["added_tokens"] if t["content"] != "<|im_end|>"]
    vocab["model"]["vocab"].pop("<|im_end|>", None)
    (tokenizer_dir / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match=r"lacks <\|im_end\|>"):
        make_model("tiny", tmp_path / "out", tokenizer_from=tokenizer_dir)
    assert not (tmp_path / "out").exists()
