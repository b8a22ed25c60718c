"""The reasoning-parser seam (docs/design.md §18): the built-in ``deepseek_r1`` and ``qwen3``
on their families' answers (vLLM's semantics), a stream fed in any pieces assembling to the
whole-text parse, plugin parsers through the ``rtpcore_register_reasoning_parsers`` hook of a
real distribution (registered, replacing a built-in, each wrong use refused), and over HTTP
against a spawned ``rtpcore serve --reasoning-parser``: ``message.reasoning`` and
``delta.reasoning`` (or ``reasoning_content``), streamed and not, reasoning sent back in an
assistant message, an unknown name exiting 2 with the known ones."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin_env import PluginEnv
from rtpcore import Allowlist, load_plugins
from rtpcore.errors import PluginConflictError, PluginIncompatibleError, PluginLoadError
from rtpcore.plugins.loading import load_report
from rtpcore.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser
from rtpcore.serving.protocol import ChatMessage

# -- the built-in parsers ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>plan it</think>The answer.", "plan it", "The answer."),
    ("plan it</think>The answer.", "plan it", "The answer."),  # the template opened <think>
    ("plan it, still thinking", "plan it, still thinking", ""),  # cut by max_tokens: all reasoning
    ("</think>Only an answer.", "", "Only an answer."),
    ("a</think>b</think>c", "a", "b</think>c"),  # the first end marker ends the reasoning
])
def test_deepseek_r1_reads_reasoning_up_to_the_end_marker(text: str, reasoning: str, content: str) -> None:
    assert DeepSeekR1ReasoningParser().extract(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>plan it</think>The answer.", "plan it", "The answer."),
    ("The answer, no thinking.", None, "The answer, no thinking."),
    ("plan it</think>The answer.", None, "plan it</think>The answer."),  # not opened: content
    ("<think>cut short", "cut short", ""),
    ("Say <think> later</think>", None, "Say <think> later</think>"),  # only at the start
])
def test_qwen3_reads_reasoning_only_in_a_block_the_answer_opens(text: str, reasoning: str | None,
                                                                content: str) -> None:
    assert Qwen3ReasoningParser().extract(text) == (reasoning, content)


def pieces(draw: Any, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


answer_text = st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "x", "y z", "\n", "<"]),
                       max_size=12).map("".join)


@settings(max_examples=400, deadline=None)
@given(data=st.data(), text=answer_text, parser=st.sampled_from([DeepSeekR1ReasoningParser, Qwen3ReasoningParser]))
def test_a_stream_in_any_pieces_assembles_to_the_whole_text_parse(data: st.DataObject, text: str,
                                                                   parser: type[ReasoningParser]) -> None:
    thinker = parser()
    reasoning = content = ""
    for piece in pieces(data.draw, text):
        r, c = thinker.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = thinker.finish()
    whole = parser().extract(text)
    assert (reasoning + r, content + c) == (whole[0] or "", whole[1])


def test_a_parser_with_only_extract_streams_everything_at_the_end() -> None:
    class Halves(ReasoningParser):
        name = "halves"

        def extract(self, text: str) -> tuple[str | None, str]:
            return text[: len(text) // 2], text[len(text) // 2:]

    thinker = Halves()
    assert [thinker.feed(p) for p in ("abc", "def")] == [("", ""), ("", "")]
    assert thinker.finish() == ("abc", "def")


def test_an_assistant_messages_reasoning_reaches_the_template_as_reasoning_content() -> None:
    for field in ("reasoning", "reasoning_content"):
        message = ChatMessage.model_validate({"role": "assistant", "content": "4", field: "2+2"})
        assert message.for_template() == {"role": "assistant", "content": "4", "reasoning_content": "2+2"}
    with pytest.raises(ValueError, match="two names of one field"):
        ChatMessage.model_validate({"role": "assistant", "content": "4", "reasoning": "a", "reasoning_content": "b"})


# -- plugins ---------------------------------------------------------------------------------------

HEADER = "from rtpcore import hookimpl\nfrom rtpcore.reasoning import ReasoningParser, ThinkTagsReasoningParser\n"


def parser_dist(env: PluginEnv, dist: str, body: str, **kw: Any) -> None:
    module = dist.replace("-", "_")
    source = HEADER + body + (
        "\n@hookimpl\ndef rtpcore_register_reasoning_parsers(registry):\n    registry.register_reasoning_parser(P)\n")
    env.add_dist(dist, plugins={module: module}, modules={f"{module}.py": source}, **kw)


SPACE = """
class P(ThinkTagsReasoningParser):
    name = "{name}"
    end = "e"
    opened = True
    replaces = {replaces}
"""


def test_a_plugin_parser_is_registered_with_its_provenance(plugin_env: PluginEnv) -> None:
    parser_dist(plugin_env, "rp-space", SPACE.format(name="space", replaces=()))
    registry = load_plugins(Allowlist.from_cli(plugins=["rp-space"]).resolve())
    cls = registry.seam_class("reasoning_parsers", "space")
    assert cls is not None and cls.__module__ == "rp_space"
    assert cls().extract("why so\nbecause") == ("why so\nb", "cause")
    assert registry.seam_provider("reasoning_parsers", "space").distribution == "rp-space"
    assert registry.seam_names("reasoning_parsers") == ["deepseek_r1", "qwen3", "space"]
    assert registry.seams_of("rp_space")["reasoning_parsers"] == ["space"]
    assert registry.seam_class("reasoning_parsers", "qwen3") is Qwen3ReasoningParser


def test_replaces_takes_over_a_built_in_name(plugin_env: PluginEnv) -> None:
    parser_dist(plugin_env, "rp-take", SPACE.format(name="better_qwen3", replaces=("qwen3",)))
    registry = load_plugins(Allowlist.from_cli(plugins=["rp-take"]).resolve())
    assert registry.seam_class("reasoning_parsers", "qwen3").__module__ == "rp_take"
    assert registry.seam_class("reasoning_parsers", "better_qwen3") is registry.seam_class("reasoning_parsers", "qwen3")


def test_a_built_in_name_without_replaces_and_one_name_twice_are_conflicts(plugin_env: PluginEnv) -> None:
    parser_dist(plugin_env, "rp-steal", SPACE.format(name="deepseek_r1", replaces=()))
    parser_dist(plugin_env, "rp-one", SPACE.format(name="mine", replaces=()))
    parser_dist(plugin_env, "rp-two", SPACE.format(name="mine", replaces=()))
    with pytest.raises(PluginConflictError, match="replaces = \\('deepseek_r1',\\)") as stolen:
        load_plugins(Allowlist.from_cli(plugins=["rp-steal"]).resolve())
    assert "reasoning parser 'deepseek_r1'" in str(stolen.value) and "rp-steal" in str(stolen.value)
    with pytest.raises(PluginConflictError, match="reasoning parser 'mine' is registered by both") as both:
        load_plugins(Allowlist.from_cli(plugins=["rp-one", "rp-two"]).resolve())
    assert "rp-one" in str(both.value) and "rp-two" in str(both.value)


@pytest.mark.parametrize(("body", "rule"), [
    ("class P:\n    name = 'x'\n    def extract(self, text):\n        return None, text\n",
     "must be a subclass of rtpcore.reasoning.ReasoningParser"),
    ("class P(ReasoningParser):\n    name = 'lazy'\n", "does not implement extract"),
    ("class P(ThinkTagsReasoningParser):\n    name = 'no spaces please'\n", "name must be letters"),
    ("class P(ThinkTagsReasoningParser):\n    name = 'x'\n    replaces = 'qwen3'\n", "replaces must be a tuple"),
    ("class P(ThinkTagsReasoningParser):\n    name = 'x'\n    replaces = ('nothing_built_in',)\n",
     "replaces 'nothing_built_in', which is not one of rtpcore's built-in reasoning parsers"),
])
def test_a_malformed_parser_is_an_invalid_plugin_and_nothing_registers(plugin_env: PluginEnv, body: str,
                                                                       rule: str) -> None:
    parser_dist(plugin_env, "rp-bad", body)
    report = load_report(Allowlist.from_cli(plugins=["rp-bad"]).resolve())
    (outcome,) = report.outcomes
    assert outcome.state == "invalid", outcome
    assert isinstance(outcome.error, PluginLoadError) and rule in str(outcome.error)
    assert "rp-bad" in str(outcome.error)
    assert report.registry.seam_names("reasoning_parsers") == ["deepseek_r1", "qwen3"]


@pytest.mark.parametrize(("version", "rule"), [("2.0", "another major"), ("1.9", "upgrade rtpcore")])
def test_a_parser_written_for_another_seam_version_is_incompatible(plugin_env: PluginEnv, version: str,
                                                                  rule: str) -> None:
    parser_dist(plugin_env, "rp-old", f"class P(ThinkTagsReasoningParser):\n    name = 'x'\n    api_version = {version!r}\n")
    report = load_report(Allowlist.from_cli(plugins=["rp-old"]).resolve())
    (outcome,) = report.outcomes
    assert outcome.state == "incompatible"
    assert isinstance(outcome.error, PluginIncompatibleError)
    assert f"reasoning_parsers API {version}" in str(outcome.error) and rule in str(outcome.error)


def child_env(env: PluginEnv) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(env.site), os.environ.get("PYTHONPATH")) if p)
    return {k: v for k, v in os.environ.items() if k != "RTPCORE_API_KEY"} | {"PYTHONPATH": path}


def test_plugins_list_shows_the_parser_in_its_seams(plugin_env: PluginEnv) -> None:
    parser_dist(plugin_env, "rp-list", SPACE.format(name="listed", replaces=()))
    out = subprocess.run([sys.executable, "-m", "rtpcore", "plugins", "list", "--json", "--plugins", "rp-list"],
                         capture_output=True, text=True, env=child_env(plugin_env), timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {row["distribution"]: row for row in json.loads(out.stdout)}
    assert rows["rtpcore"]["seams"]["reasoning_parsers"] == ["deepseek_r1", "qwen3"]
    assert rows["rp-list"]["seams"]["reasoning_parsers"] == ["listed"]
    assert set(rows["rp-list"]["seams"]) >= {"models", "kv_layouts", "tool_parsers", "reasoning_parsers"}


# -- over HTTP ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_llama import make_checkpoint
    from test_serve import write_tokenizer

    path = tmp_path_factory.mktemp("reasoning")
    make_checkpoint(path, vocab_size=write_tokenizer(path), max_position_embeddings=256)
    return path


@pytest.fixture(scope="module")
def space_server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server whose reasoning parser is a plugin's: the answer up to its first "e" is
    reasoning (the built-in tag parser's stream logic, with a marker the seeded tiny model writes)."""
    from test_serve import Server

    env = PluginEnv(tmp_path_factory.mktemp("reasoning-site"))
    try:
        parser_dist(env, "rp-http", SPACE.format(name="space", replaces=()))
        srv = Server(checkpoint, "--plugins", "rp-http", "--reasoning-parser", "space", env=child_env(env))
    finally:
        sys.path.remove(str(env.site))
    yield srv
    code, out = srv.stop()
    assert code == 0, out


CHAT = {"model": "tiny", "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": "the capital"}]}


def plain_answer(url: str) -> str:
    """The same conversation's greedy text, as /v1/completions writes it for its token ids."""
    ids = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": CHAT["messages"]}, timeout=120).json()["tokens"]
    answer = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 24,
                                                       "temperature": 0}, timeout=120)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


def test_a_chat_answer_carries_the_reasoning_apart_streamed_and_not(space_server: Any) -> None:
    text = plain_answer(space_server.url)
    assert "e" in text, f"the tiny model's answer has no 'e' to split at: {text!r}"
    expected = (text.partition("e")[0], text.partition("e")[2])
    whole = httpx.post(space_server.url + "/v1/chat/completions", json=CHAT, timeout=120)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == expected
    stream = space_server.client().chat.completions.create(**{**CHAT, "stream": True})
    reasoning = content = ""
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == expected


def test_reasoning_sent_back_in_an_assistant_message_is_accepted(space_server: Any) -> None:
    messages = [*CHAT["messages"], {"role": "assistant", "content": "Paris", "reasoning": "it is Paris"},
                {"role": "user", "content": "and Italy"}]
    answer = httpx.post(space_server.url + "/v1/chat/completions", json={**CHAT, "messages": messages}, timeout=120)
    assert answer.status_code == 200, answer.text


def test_reasoning_content_is_the_field_with_reasoning_field(checkpoint: Path) -> None:
    from test_serve import Server

    srv = Server(checkpoint, "--reasoning-parser", "deepseek_r1", "--reasoning-field", "reasoning_content")
    try:
        text = plain_answer(srv.url)
        message = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=120).json()["choices"][0]["message"]
    finally:
        code, out = srv.stop()
    assert code == 0, out
    assert "reasoning" not in message
    assert (message["reasoning_content"], message["content"]) == DeepSeekR1ReasoningParser().extract(text)


def test_an_unknown_reasoning_parser_exits_2_naming_the_known_ones(checkpoint: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "rtpcore", "serve", str(checkpoint), "--reasoning-parser", "nope",
                          "--port", "8999"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "--reasoning-parser 'nope' is not a known parser; known: deepseek_r1, qwen3" in out.stderr
