"""Request bodies as vLLM's own benchmark client (`vllm bench serve`) sends them are accepted;
its fields at values we cannot honour are 400s that name them."""

from __future__ import annotations

import pytest

from dualpath.server.errors import APIError
from dualpath.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

# vllm/benchmarks/lib/endpoint_request_func.py, vLLM 0.32: the openai backend's body.
VLLM_BENCH_COMPLETION = {
    "model": "tiny",
    "prompt": "def fib(n):",
    "repetition_penalty": 1.0,
    "max_tokens": 8,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}
# Its openai-chat backend's body.
VLLM_BENCH_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "def fib(n):"}]}],
    "max_completion_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}


def test_vllm_bench_bodies_are_accepted() -> None:
    CompletionRequest.model_validate(VLLM_BENCH_COMPLETION).check_supported()
    ChatCompletionRequest.model_validate(VLLM_BENCH_CHAT).check_supported()
    ChatCompletionRequest.model_validate(
        {**VLLM_BENCH_CHAT, "repetition_penalty": 1}
    ).check_supported()
    # Its prompt alignment asks /tokenize for the ids a prompt gets, without special tokens.
    TokenizeRequest.model_validate(
        {"model": "tiny", "prompt": "x", "add_special_tokens": False}
    ).check_supported()


@pytest.mark.parametrize(
    ("request_type", "body", "param"),
    [
        (CompletionRequest, {**VLLM_BENCH_COMPLETION, "repetition_penalty": 1.1}, "repetition_penalty"),
        (ChatCompletionRequest, {**VLLM_BENCH_CHAT, "repetition_penalty": 0.9}, "repetition_penalty"),
        (TokenizeRequest, {"prompt": "x", "add_special_tokens": True}, "add_special_tokens"),
    ],
)  # fmt: skip
def test_what_we_cannot_honour_is_a_400_naming_it(
    request_type: type, body: dict, param: str
) -> None:
    with pytest.raises(APIError) as raised:
        request_type.model_validate(body).check_supported()
    assert raised.value.status == 400 and raised.value.param == param
    assert "not supported" in raised.value.message
