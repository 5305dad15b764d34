"""Chat rendering: the embedded template with every role and tool calls, the checkpoint's
template, and the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.server.chat import ChatRenderer, ChatTemplateError
from dualpath.server.protocol import ChatMessage

CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"d": "."}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"},
]


def render(renderer: ChatRenderer, messages: list[dict], **kwargs) -> str:
    return renderer.render([ChatMessage(**m).to_template() for m in messages], **kwargs)


def test_default_template_renders_every_role_and_tool_calls() -> None:
    text = render(ChatRenderer(None), CONVERSATION)
    assert text == (
        "<|im_start|>systemYou are a coding agent.<|im_end|>"
        "<|im_start|>userList the files.<|im_end|>"
        "<|im_start|>assistant"
        '<tool_call>{"name": "ls", "arguments": "{\\"d\\": \\".\\"}"}</tool_call><|im_end|>'
        "<|im_start|>toola.py b.py<|im_end|>"
        "<|im_start|>assistant"
    )


def test_rendering_matches_transformers_apply_chat_template(tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    messages = [ChatMessage(**m).to_template() for m in CONVERSATION]
    expected = reference.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    ours = ChatRenderer.for_checkpoint(tiny_model_dir).render(messages, tools=tools)
    assert ours == expected


def test_turn_two_starts_with_turn_one_so_its_kv_is_reused() -> None:
    renderer = ChatRenderer(None)
    turn_one = render(renderer, CONVERSATION[:2], add_generation_prompt=False)
    turn_two = render(renderer, CONVERSATION)
    assert turn_two.startswith(turn_one)


def test_the_checkpoints_template_and_special_tokens_are_used(tmp_path: Path) -> None:
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    template += "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": {"content": "<s>"}})
    )
    renderer = ChatRenderer.for_checkpoint(tmp_path)
    assert not renderer.is_default
    tools = [{"type": "function", "function": {"name": "ls"}}]
    text = renderer.render([{"role": "user", "content": "hi"}], tools=tools)
    assert text == '<s>[user]hi<tools>[{"type": "function", "function": {"name": "ls"}}]</tools>'


def test_a_checkpoint_without_a_template_gets_the_default(tmp_path: Path) -> None:
    assert ChatRenderer.for_checkpoint(tmp_path).is_default


def test_template_refusals_and_sandbox_escapes_are_template_errors() -> None:
    refusing = ChatRenderer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        refusing.render([{"role": "user", "content": "x"}])
    escaping = ChatRenderer("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        escaping.render([{"role": "user", "content": "x"}])
    mutating = ChatRenderer("{% set _ = messages.append(1) %}")
    with pytest.raises(ChatTemplateError):
        mutating.render([{"role": "user", "content": "x"}])


def test_non_text_content_parts_are_refused() -> None:
    message = ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(Exception, match="only text content parts"):
        message.to_template()
