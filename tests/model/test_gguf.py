"""`dualpath convert-gguf` on the real SmolLM2-135M-Instruct GGUF, against transformers loading
the same file, and on GGUFs it must refuse."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dualpath import LLM, SamplingParams
from dualpath.errors import CheckpointError
from dualpath.model.default import bundled_gguf_path
from dualpath.model.gguf import convert_gguf
from dualpath.model.layerwise import PackedBatch
from dualpath.model.loader import load_model
from tests.test_cli import run_cli

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loader (dequantizes with the same library, float32)."""
    path = bundled_gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return tokenizer, model.eval()


def _corpus_ids(loaded, num_tokens: int) -> torch.Tensor:
    text = (Path(__file__).parents[2] / "dualpath/model/data/corpus.txt").read_text()
    ids = loaded.tokenizer.encode(text)
    assert len(ids) >= num_tokens
    return torch.tensor(ids[:num_tokens])


def test_converted_checkpoint_is_what_a_hugging_face_directory_holds(
    smollm2_model_dir: Path,
) -> None:
    names = sorted(p.name for p in smollm2_model_dir.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((smollm2_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert config["tie_word_embeddings"] is True
    tokenizer_config = json.loads((smollm2_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert (
        json.loads((smollm2_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    )


def test_logits_on_real_weights_match_transformers_loading_the_gguf(
    smollm2_model_dir: Path, reference
) -> None:
    """2,048 tokens: long enough that a wrong rope θ or a wrong q/k row order shows."""
    ours = load_model(smollm2_model_dir)
    ids = _corpus_ids(ours, 2048)
    past = ours.model.empty_past()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            expected = reference[1](ids[None]).logits[0]
        logits, _ = ours.model.forward_full(ids, PackedBatch((0,), (len(ids),)), past)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)


def test_greedy_answer_matches_transformers_and_is_right(
    smollm2_model_dir: Path, reference
) -> None:
    tokenizer, model = reference
    prompt = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    with LLM(smollm2_model_dir) as llm:
        ids = llm.tokenizer.encode(prompt)
        assert ids == tokenizer.encode(prompt)  # the rebuilt tokenizer agrees on a chat prompt
        out = llm.generate(
            {"prompt_token_ids": ids}, SamplingParams(max_tokens=24, ignore_eos=True)
        )[0]
    expected = model.generate(
        torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None
    )[0, len(ids) :]
    assert out.token_ids == expected.tolist()
    assert out.text.startswith("The capital of France is Paris.<|im_end|>")


def test_pre_tokenizer_isolates_digits_as_llama_cpp_smollm_does(smollm2_model_dir: Path) -> None:
    """The GGUF says ``tokenizer.ggml.pre = "smollm"``: every digit is split off before GPT-2's
    regex (llama.cpp's rule, and the original tokenizer's Digits(individual_digits))."""
    ours = load_model(smollm2_model_dir).tokenizer
    assert [ours.decode([i]) for i in ours.encode("\n 2 files")] == ["\n ", "2", " files"]
    assert [ours.decode([i]) for i in ours.encode("x=123")] == ["x", "=", "1", "2", "3"]


def _write_gguf(path: Path, arch: str, fields: dict[str, int]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "in")


def test_unsupported_architecture_is_refused_by_name_leaving_nothing(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "gpt2.gguf"
    _write_gguf(src, "gpt2", {"gpt2.block_count": 2})
    with pytest.raises(CheckpointError, match="GGUF architecture 'gpt2' is not supported"):
        convert_gguf(src, tmp_path / "out")
    assert _leftovers(tmp_path) == []


def test_unmapped_llama_field_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "moe.gguf"
    _write_gguf(src, "llama", {"llama.block_count": 2, "llama.expert_count": 8})
    with pytest.raises(CheckpointError, match="llama.expert_count"):
        convert_gguf(src, tmp_path / "out")
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("num_bytes", [3000, 20_000_000])
def test_truncated_gguf_is_a_cli_error_leaving_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, num_bytes: int
) -> None:
    """Cut in the metadata, and cut in the tensor data."""
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "cut.gguf"
    with open(bundled_gguf_path(), "rb") as full:
        src.write_bytes(full.read(num_bytes))
    code, _, err = run_cli(capsys, "convert-gguf", str(src), "--out", str(tmp_path / "out"))
    assert code == 2
    assert "truncated or corrupt GGUF file" in err and str(src) in err
    assert _leftovers(tmp_path) == []


def test_not_a_gguf_and_an_existing_output_are_cli_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "x.gguf"
    src.write_text("hello")
    code, _, err = run_cli(capsys, "convert-gguf", str(src), "--out", str(tmp_path / "out"))
    assert code == 2 and "not a GGUF file" in err
    (tmp_path / "out").mkdir()
    code, _, err = run_cli(capsys, "convert-gguf", str(src), "--out", str(tmp_path / "out"))
    assert code == 2 and "already exists" in err and "--force" in err
