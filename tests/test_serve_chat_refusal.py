"""A large chat body's conversation judged in the body parser's worker process
(rtpcore.serving.json_body.chat_refusal): exactly the judgement the server's own path makes
(``ChatMessage.for_template``, the chat template, the length bound), for every body of the
shape it judges, and no judgement for any other shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtpcore.engine.text.chat_template import ChatTemplate
from rtpcore.errors import ChatTemplateError
from rtpcore.serving.json_body import BodyParser, chat_refusal
from rtpcore.serving.protocol import (
    MAX_MESSAGES,
    MESSAGE_ROLES,
    TEMPLATE_AS_SENT,
    ChatCompletionRequest,
)

# ChatML, with a name written when a message has one, and a refusal of a system message that is
# not the first: a template that reads more than role and content, and one that can refuse.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}{{ raise_exception('a system message must be first') }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] }}{% if message.name is defined %}{{ ' ' + message.name }}"
    "{% endif %}{{ '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + '<|im_start|>assistant\n' }}{% endif %}"
)


def rules(max_chars: int) -> dict[str, Any]:
    return {"model": "tiny", "templates": {"default": TEMPLATE}, "special_tokens": {"bos_token": "<s>"},
            "max_chars": max_chars, "max_messages": MAX_MESSAGES, "roles": list(MESSAGE_ROLES),
            "keys": list(TEMPLATE_AS_SENT)}


def server_judgement(body: dict[str, Any], max_chars: int) -> tuple[str, Any] | None:
    """What the server's own path decides for ``body``: validated, each message through
    ``for_template``, rendered as ``requests.render_chat`` renders it, measured."""
    request = ChatCompletionRequest.model_validate(body)
    generation = request.add_generation_prompt if request.add_generation_prompt is not None else True
    try:
        text = ChatTemplate(TEMPLATE, special_tokens={"bos_token": "<s>"}).render(
            [m.for_template() for m in request.messages], add_generation_prompt=generation)
    except ChatTemplateError as exc:
        return ("template", str(exc))
    return ("length", len(text)) if len(text) > max_chars else None


text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)
content = st.one_of(st.none(), text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                               max_size=3))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(MESSAGE_ROLES), "content": content},
    optional={"name": st.one_of(st.none(), text)},
)
plain_body = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(message, min_size=1, max_size=6)},
    optional={"add_generation_prompt": st.one_of(st.none(), st.booleans()),
              "continue_final_message": st.one_of(st.none(), st.just(False)), "tools": st.none()},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=plain_body, max_chars=st.integers(0, 400))
def test_the_worker_judges_a_plain_conversation_as_the_server_does(body: dict[str, Any], max_chars: int) -> None:
    body = json.loads(json.dumps(body))  # what the worker sees: parsed JSON
    assert chat_refusal(body, rules(max_chars)) == server_judgement(body, max_chars)


@pytest.mark.parametrize("change", [
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"chat_template_kwargs": {"x": 1}},
    {"reasoning_effort": "low"},
    {"continue_final_message": True},
    {"model": "another"},
    {"add_generation_prompt": "yes"},
    {"messages": []},
    {"messages": [{"role": "user", "content": "x" * 500, "tool_calls": []}]},
    {"messages": [{"role": "user", "content": "x" * 500, "name": 3}]},
    {"messages": [{"role": "robot", "content": "x" * 500}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
    {"messages": "x" * 500},
], ids=lambda c: next(iter(c)) + ":" + json.dumps(next(iter(c.values())))[:24])
def test_a_body_of_any_other_shape_is_left_to_the_server(change: dict[str, Any]) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 500}], **change}
    assert chat_refusal(body, rules(100)) is None
    assert chat_refusal({"model": "tiny", "messages": [{"role": "user", "content": "x" * 500}]},
                        rules(100)) == ("length", len("<|im_start|>user\n" + "x" * 500 + "<|im_end|>\n<s><|im_start|>assistant\n"))


def test_the_worker_refuses_a_long_conversation_and_sends_no_value_back() -> None:
    parser = BodyParser(offload_bytes=16, chat_rules=lambda: rules(1000))
    long = {"model": "tiny", "messages": [{"role": "user", "content": "y" * 5000}]}
    short = {"model": "tiny", "messages": [{"role": "user", "content": "y" * 50}]}
    misplaced = {"model": "tiny", "messages": [{"role": "user", "content": "a" * 50},
                                               {"role": "system", "content": "b" * 50}]}
    try:
        refused = asyncio.run(parser.parse(json.dumps(long).encode(), chat=True))
        fits = asyncio.run(parser.parse(json.dumps(short).encode(), chat=True))
        rejected = asyncio.run(parser.parse(json.dumps(misplaced).encode(), chat=True))
        not_chat = asyncio.run(parser.parse(json.dumps(long).encode()))  # another route: only parsed
    finally:
        parser.close()
    assert refused.refusal == server_judgement(long, 1000) and refused.refusal[0] == "length"
    assert refused.value is None and not refused.ok
    assert fits.ok and fits.refusal is None and fits.value == short
    assert rejected.refusal == server_judgement(misplaced, 1000)
    assert rejected.refusal is not None and "a system message must be first" in rejected.refusal[1]
    assert not_chat.ok and not_chat.value == long


def test_a_parser_without_chat_rules_only_parses() -> None:
    parser = BodyParser(offload_bytes=16)
    long = {"model": "tiny", "messages": [{"role": "user", "content": "y" * 5000}]}
    try:
        parsed = asyncio.run(parser.parse(json.dumps(long).encode(), chat=True))
    finally:
        parser.close()
    assert parsed.ok and parsed.value == long
