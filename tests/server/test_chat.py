"""Chat rendering: the embedded template with every role, tools and tool calls (Qwen2.5's
layout), an agent's turn 2 repeating turn 1's prompt and answer, the checkpoint's templates
(``chat_template.jinja`` first, as in transformers), and the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.errors import CheckpointError
from dualpath.model.tokenizer import read_chat_templates
from dualpath.server.chat import ChatRenderer, ChatTemplateError
from dualpath.server.errors import APIError
from dualpath.server.protocol import ChatMessage
from dualpath.server.responses import chat_message

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


TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]


def test_default_template_renders_every_role_and_tool_calls() -> None:
    messages = [*CONVERSATION, {"role": "developer", "content": "Be brief."}]
    text = render(ChatRenderer(None), messages)
    assert text == (
        "<|im_start|>system\nYou are a coding agent.<|im_end|>\n"
        "<|im_start|>user\nList the files.<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "ls", "arguments": {"d": "."}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.py b.py\n</tool_response><|im_end|>\n"
        "<|im_start|>developer\nBe brief.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_default_template_puts_tools_in_the_system_turn_as_qwen_does() -> None:
    text = render(ChatRenderer(None), CONVERSATION[:2], tools=TOOLS)
    assert text == (
        "<|im_start|>system\nYou are a coding agent.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "ls", "parameters": {}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n"
    )
    without_system = render(ChatRenderer(None), CONVERSATION[1:2], tools=TOOLS)
    assert without_system.startswith("<|im_start|>system\n# Tools\n\n")


def test_tool_results_in_a_row_share_one_user_turn_and_calls_with_text_follow_it() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "Two calls.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": ""}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "2"}]},
    ]
    text = render(ChatRenderer(None), messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>user\ngo<|im_end|>\n"
        "<|im_start|>assistant\nTwo calls.\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": [1]}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n"
        "<tool_response>\n2\n</tool_response><|im_end|>\n"
    )


@pytest.mark.parametrize(
    "answer",
    [
        '<tool_call>\n{"name": "ls", "arguments": {"d": "."}}\n</tool_call>',
        'Looking.\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "cat", "arguments": {"path": "a.py", "n": [1, 2]}}\n</tool_call>',
    ],
)
def test_turn_two_repeats_turn_ones_prompt_and_answer(answer: str) -> None:
    # Turn 1's answer, as the client gets it back (arguments as JSON strings) and sends it in
    # turn 2, renders as the model wrote it: turn 2's prompt starts with turn 1's prompt and
    # answer, so their KV is found in the store.
    renderer = ChatRenderer(None)
    turn_one = CONVERSATION[:2]
    prompt = render(renderer, turn_one, tools=TOOLS)
    message, finish_reason = chat_message(answer, "stop", parses_tool_calls=True)
    assert finish_reason == "tool_calls"
    results = [
        {"role": "tool", "tool_call_id": call["id"], "content": "ok"}
        for call in message["tool_calls"]
    ]
    turn_two = render(renderer, [*turn_one, message, *results], tools=TOOLS)
    assert turn_two.startswith(prompt + answer + "<|im_end|>\n")


def test_compact_json_from_the_model_renders_back_with_spaces() -> None:
    # The documented limit: arguments are json.dumps of the parsed object, so a model that
    # writes compact JSON is not repeated token for token (vLLM has the same limit).
    answer = '<tool_call>\n{"name":"ls","arguments":{"d":"."}}\n</tool_call>'
    message, _ = chat_message(answer, "stop", parses_tool_calls=True)
    turn_two = render(ChatRenderer(None), [*CONVERSATION[:2], message], tools=TOOLS)
    assert answer not in turn_two
    assert '{"name": "ls", "arguments": {"d": "."}}' in turn_two


def test_arguments_that_are_not_json_are_refused() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    for arguments in ("{oops", '{"x": NaN}'):
        call["function"]["arguments"] = arguments
        with pytest.raises(APIError, match="tool call 'c': arguments are not valid JSON"):
            ChatMessage(role="assistant", tool_calls=[call]).to_template()


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


def test_a_message_without_content_is_the_empty_string_to_a_template() -> None:
    """As vLLM hands it to a template that reads strings (SmolLM2's adds strings: None would
    not render)."""
    renderer = ChatRenderer(
        "{% for m in messages %}{{ '<' + m.role + '>' + m.content }}{% endfor %}"
    )
    call = ChatMessage.model_validate(
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": ""}}],
        }
    )
    assert renderer.render([{"role": "user", "content": "hi"}, call.to_template()]) == (
        "<user>hi<assistant>"
    )


def test_a_checkpoint_without_a_template_gets_the_default(tmp_path: Path) -> None:
    assert ChatRenderer.for_checkpoint(tmp_path).is_default


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path: Path) -> None:
    # transformers >= 5 saves the template beside tokenizer_config.json, not in it.
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "old", "eos_token": "</s>"})
    )
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}new")
    renderer = ChatRenderer.for_checkpoint(tmp_path)
    assert renderer.render([{"role": "user", "content": "x"}]) == "</s>new"
    assert read_chat_templates(tmp_path) == {"default": "{{ eos_token }}new"}


def test_named_templates_and_the_tool_use_one(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    renderer = ChatRenderer.for_checkpoint(tmp_path)
    assert renderer.render([{"role": "user", "content": "x"}]) == "plain"
    assert renderer.render([{"role": "user", "content": "x"}], tools=TOOLS) == "tools"
    # The files transformers >= 5 writes for the same templates replace the config's.
    (tmp_path / "chat_template.jinja").write_text("plain 2")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools 2")
    assert read_chat_templates(tmp_path) == {"default": "plain 2", "tool_use": "tools 2"}


def test_an_unreadable_tokenizer_config_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        ChatRenderer.for_checkpoint(tmp_path)


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
