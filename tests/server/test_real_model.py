"""`dualpath serve` on the embedded default's real weights (SmolLM2-135M-Instruct), asked what a
new user asks first, through the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.serving import Server, start_server

FRANCE = {"role": "user", "content": "What is the capital of France? Answer in one sentence."}


@pytest.fixture(scope="module")
def server(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(smollm2_model_dir, tmp_path_factory.mktemp("real")) as running:
        yield running


def _chat(server: Server, messages: list[dict], max_tokens: int):
    return server.client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=max_tokens
    )


def test_the_france_question_is_answered_with_paris(server: Server) -> None:
    out = _chat(server, [FRANCE], 40)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"  # the chat end token, not the length cap
    assert "<|im_end|>" not in out.choices[0].message.content


def test_turn_two_finds_turn_one_prompt_and_answer_in_the_store(server: Server) -> None:
    """A chat that extends turn 1 reuses >= 90% of turn 1's prompt + answer (everything but
    the partial last KV block)."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()[:4000]
    messages = [{"role": "user", "content": f"{readme}\n\nIn one sentence, what is this?"}]
    first = _chat(server, messages, 48)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what does `make test` do?"},
    ]
    second = _chat(server, messages, 8)
    turn_one_tokens = first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.usage.prompt_tokens > 1000
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.9 * turn_one_tokens, (cached, turn_one_tokens)
