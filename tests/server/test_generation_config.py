"""A checkpoint's generation_config.json as vLLM applies it: the sampling defaults of requests
that omit them, a refusal to start for sampling we do not implement, and `--generation-config
none` to serve with ours. (tests/server/test_tool_call_serving.py starts a real server on
such a checkpoint.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dualpath.cli import build_parser
from dualpath.cli.serve_settings import resolve
from dualpath.errors import CheckpointError
from dualpath.model.generation_config import SamplingDefaults, read_sampling_defaults
from dualpath.server.config import ServerConfig
from dualpath.server.context import sampling_defaults
from dualpath.server.protocol import ChatCompletionRequest, CompletionRequest, sampling_params

QWEN_LIKE = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "max_new_tokens": 512,
    "transformers_version": "4.37.0",
}


def checkpoint(tmp_path: Path, generation_config: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def test_the_files_sampling_values_are_read(tmp_path: Path) -> None:
    defaults = read_sampling_defaults(checkpoint(tmp_path, QWEN_LIKE))
    assert defaults == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, max_tokens=512)
    assert defaults.describe() == "temperature=0.7 top_p=0.8 top_k=20 max_tokens=512"


def test_no_file_or_no_sampling_values_means_no_defaults(tmp_path: Path) -> None:
    assert read_sampling_defaults(tmp_path) == SamplingDefaults()
    only_ids = {"eos_token_id": 2, "bos_token_id": 1, "transformers_version": "4.42.3"}
    assert read_sampling_defaults(checkpoint(tmp_path, only_ids)) == SamplingDefaults()


def test_neutral_values_of_what_we_do_not_implement_are_fine(tmp_path: Path) -> None:
    neutral = {"repetition_penalty": 1.0, "min_p": 0, "num_beams": 1, "bad_words_ids": None}
    assert read_sampling_defaults(checkpoint(tmp_path, {**neutral, "top_k": -1})) == (
        SamplingDefaults(top_k=0)
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", -0.5),
        ("temperature", True),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", 2.5),
        ("top_k", -2),
        ("max_new_tokens", 0),
    ],
)
def test_a_malformed_value_is_a_checkpoint_error(tmp_path: Path, field: str, value) -> None:
    with pytest.raises(CheckpointError, match=f"generation_config.json: {field} must be"):
        read_sampling_defaults(checkpoint(tmp_path, {field: value}))


def test_a_file_that_is_not_json_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="cannot be parsed as JSON"):
        read_sampling_defaults(tmp_path)


def test_sampling_we_do_not_implement_refuses_to_start_and_names_the_way_out(
    tmp_path: Path,
) -> None:
    model_dir = checkpoint(
        tmp_path, {**QWEN_LIKE, "repetition_penalty": 1.05, "min_p": 0.1, "num_beams": 4}
    )
    with pytest.raises(ValueError) as refusal:
        sampling_defaults(model_dir, "auto")
    message = str(refusal.value)
    assert "repetition_penalty=1.05, min_p=0.1, num_beams=4" in message
    assert "--generation-config none" in message
    assert sampling_defaults(model_dir, "none") == SamplingDefaults()


def test_the_defaults_in_use_are_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        defaults = sampling_defaults(checkpoint(tmp_path, QWEN_LIKE), "auto")
    assert defaults.temperature == 0.7
    assert "temperature=0.7 top_p=0.8 top_k=20 max_tokens=512" in caplog.text


def test_a_request_that_omits_a_value_gets_the_checkpoints_then_ours() -> None:
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, max_tokens=512)
    messages = [{"role": "user", "content": "hi"}]
    omitted = ChatCompletionRequest(model="m", messages=messages)
    params = sampling_params(omitted, max_tokens=8, seed=None, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.8, 20)
    given = ChatCompletionRequest(model="m", messages=messages, temperature=0, top_p=1, top_k=-1)
    params = sampling_params(given, max_tokens=8, seed=None, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0, 1, 0)
    nulls = CompletionRequest(model="m", prompt="x", temperature=None, top_p=None, top_k=None)
    params = sampling_params(nulls, max_tokens=8, seed=None, defaults=SamplingDefaults())
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)  # OpenAI's


def test_serve_has_the_flag_and_the_config_checks_it() -> None:
    args = build_parser().parse_args(["serve", "--generation-config", "none"])
    assert resolve(args, args.serve_options).generation_config == "none"
    args = build_parser().parse_args(["serve"])
    assert resolve(args, args.serve_options).generation_config == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert ServerConfig(served_model_name="m").generation_config == "auto"
    with pytest.raises(ValueError, match="generation_config must be one of auto, none"):
        ServerConfig(served_model_name="m", generation_config="vllm")
