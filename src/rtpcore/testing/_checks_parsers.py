"""The kit's checks on text parsers (docs/design.md §16, §18, §19): ``reasoning_parser`` and
``tool_parser``. Both hold a parser's streaming path to its whole-text path, exactly:

* ``reasoning_parser``: exact. Every text (think tags or none, empty reasoning, unclosed,
  unicode) fed to a fresh instance in pieces at every split point, one character at a time,
  and at seeded random points, then ``finish``, joins to what ``extract`` returns.
* ``tool_parser``: every answer (none, one or two calls after each of the parser's markers, in
  JSON, malformed, with unicode, with text around them), from its marker on as the server hands
  it over, fed to a fresh instance in pieces (every split point, one character at a time, seeded
  random points), gives through ``feed`` then ``finish`` the calls and the content that
  ``parse`` gives for the whole text: the calls ``feed`` returned, then ``finish``'s.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

from rtpcore.testing.kit import KitContext, fail

__all__: list[str] = []


def _seam_class(ctx: KitContext, seam: str, name: str) -> Any:
    cls = ctx.registry.seam_class(seam, name)
    if cls is None:
        raise fail(seam.rstrip("s"), f"{name!r} is listed on the seam {seam} but the registry has no class for it")
    return cls


# -- reasoning_parser ------------------------------------------------------------------------

_TEXTS = (
    "",
    "plain answer, no tags at all",
    "<think>step one, step two</think>The answer is 42.",
    "<think></think>content after empty reasoning",
    "<think>\n</think>\n\ncontent",
    "reasoning with no opening tag</think>answer",
    "<think>a block never closed",
    "<think><think>twice opened</think>then </think> again",
    "  <think>after spaces</think>x",
    "<thi",
    "</think>",
    "<think>x</thin",
    "a < b and c </ d <think",
    "<think>ünïcödé 思考 🙂 — ok</think>答案：✓ émoji 🎉",
)
_RANDOM_SPLITS = 20
_SEED = 0


def reasoning_parser(ctx: KitContext, name: str) -> str | None:
    cls = _seam_class(ctx, "reasoning_parsers", name)
    rng = random.Random(_SEED)
    runs = 0
    for text in _TEXTS:
        reasoning, content = cls().extract(text)
        if not (reasoning is None or isinstance(reasoning, str)) or not isinstance(content, str):
            raise fail("reasoning_parser", f"extract({text!r}) returned {(reasoning, content)!r}: want (str or None, "
                                           "str)")
        expected = (reasoning or "", content)
        for cuts in _splits(text, rng):
            runs += 1
            pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)), strict=True)]
            got = _stream(cls, text, cuts, pieces)
            if got != expected:
                raise fail("reasoning_parser", f"text {text!r} fed in pieces {pieces!r} (split at {list(cuts)}), then "
                                               f"finish: assembled (reasoning, content) {got!r}; extract returned "
                                               f"{(reasoning, content)!r}")
    return f"{len(_TEXTS)} texts, {runs} ways of splitting them"


def _splits(text: str, rng: random.Random) -> Iterator[tuple[int, ...]]:
    """Split points: none, each single one, every character alone, and seeded random sets."""
    n = len(text)
    yield ()
    for i in range(1, n):
        yield (i,)
    if n > 2:
        yield tuple(range(1, n))
        for _ in range(_RANDOM_SPLITS):
            yield tuple(sorted(rng.sample(range(1, n), rng.randint(2, min(5, n - 1)))))


def _stream(cls: Any, text: str, cuts: tuple[int, ...], pieces: list[str]) -> tuple[str, str]:
    parser = cls()
    reasoning, content = [], []
    for step, piece in enumerate([*pieces, None]):
        out = parser.finish() if piece is None else parser.feed(piece)
        call = "finish()" if piece is None else f"feed({piece!r})"
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(s, str) for s in out)):
            raise fail("reasoning_parser", f"text {text!r} split at {list(cuts)}: {call} (call {step + 1}) returned "
                                           f"{out!r}: want (reasoning_delta, content_delta), two strings")
        reasoning.append(out[0])
        content.append(out[1])
    return "".join(reasoning), "".join(content)


# -- tool_parser ------------------------------------------------------------------------------

_TOOLS = ({"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}}}}},)
_CALLS = (
    json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}),
    json.dumps({"name": "get_weather", "arguments": {"city": "Zürich 東京"}}, ensure_ascii=False),
    '{"name": "get_weather", "arguments": {"city": ',  # cut off
    "not json at all",
)


def _tool_texts(cls: Any) -> list[str]:
    """Answers from a marker on, as the server hands them to ``feed`` (and a few without one)."""
    texts = ["", "plain content, no call"]
    for marker in dict.fromkeys([*cls.markers, *(m for m in cls.prefix_markers if m)]):
        for call in _CALLS:
            texts.append(f"{marker}{call}")
        texts.append(f"{marker}{_CALLS[0]}\n{marker}{_CALLS[1]}")
        texts.append(f"{marker}{_CALLS[0]} and some words after")
    if "" in cls.prefix_markers:
        texts += list(_CALLS[:2])
        texts.append(json.dumps([json.loads(_CALLS[0]), json.loads(_CALLS[1])], ensure_ascii=False))
    return texts


def tool_parser(ctx: KitContext, name: str) -> str | None:
    from rtpcore.plugins.tool_parser import ParsedToolCalls

    cls = ctx.registry.get_tool_parser(name)
    if cls is None:
        raise fail("tool_parser", f"{name!r} is listed as a tool parser but the registry has no class for it")
    rng = random.Random(_SEED)
    runs = 0
    calls_seen = 0
    for text in _tool_texts(cls):
        whole = cls(_TOOLS).parse(text)
        if not isinstance(whole, ParsedToolCalls):
            raise fail("tool_parser", f"parse({text!r}) returned {whole!r}, not a ParsedToolCalls")
        calls_seen += len(whole.calls)
        for cuts in _splits(text, rng):
            runs += 1
            pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)), strict=True)]
            parser = cls(_TOOLS)
            streamed: list[Any] = []
            for piece in pieces:
                out = parser.feed(piece)
                if not isinstance(out, tuple):
                    raise fail("tool_parser", f"answer {text!r} split at {list(cuts)}: feed({piece!r}) returned "
                                              f"{out!r}, not a tuple of ToolCall")
                streamed += out
            end = parser.finish()
            if not isinstance(end, ParsedToolCalls):
                raise fail("tool_parser", f"answer {text!r} split at {list(cuts)}: finish() returned {end!r}, not a "
                                          "ParsedToolCalls")
            got = ParsedToolCalls(end.content, (*streamed, *end.calls))
            if got != whole:
                raise fail("tool_parser", f"answer {text!r} fed in pieces {pieces!r} (split at {list(cuts)}), then "
                                          f"finish: content {got.content!r} and calls {list(got.calls)!r}; parse of "
                                          f"the whole answer: content {whole.content!r} and calls {list(whole.calls)!r}")
    if calls_seen == 0:
        return (f"{runs} streamed answers agree with parse; none of the kit's answers holds a call in this "
                "parser's format, so only content was compared")
    return f"{runs} streamed answers agree with parse ({calls_seen} calls found whole)"
