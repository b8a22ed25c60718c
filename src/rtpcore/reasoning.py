"""Reasoning parsers: how a thinking model's answer splits into its reasoning and its content
(docs/design.md §18).

A model that thinks before it answers writes its thoughts in its text, marked the way its
family marks them (DeepSeek-R1 and Qwen3: between ``<think>`` and ``</think>``). A reasoning
parser finds them; ``rtpcore serve --reasoning-parser NAME`` then answers chat completions with
``message.reasoning`` (streamed: ``delta.reasoning``) apart from ``message.content``, and tool
calls are looked for in the content only. A plugin adds a parser for its family::

    from rtpcore import hookimpl
    from rtpcore.reasoning import ReasoningParser

    class MyThink(ReasoningParser):
        name = "my_family"

        def extract(self, text):
            ...                              # -> (reasoning or None, content)

    @hookimpl
    def rtpcore_register_reasoning_parsers(registry):
        registry.register_reasoning_parser(MyThink)

One instance serves one answer: built with no arguments, it is given the whole text
(:meth:`ReasoningParser.extract`), or the text piece by piece as it streams
(:meth:`~ReasoningParser.feed`, then :meth:`~ReasoningParser.finish`). The pieces, joined,
are what ``extract`` returns for the joined text (a ``None`` reasoning counting as ``""``). A
parser that implements only ``extract`` works as is: the default ``feed`` keeps the pieces and
the default ``finish`` extracts once, so its stream shows everything at the end. The built-in
parsers stream as the text comes, holding back only what may be the start of a marker.
:data:`REASONING_FIELDS` names the fields the server can return the reasoning in.

Built in (vLLM's parsers of the same names; where they differ, said below):

- ``deepseek_r1``: the model thinks first -- DeepSeek-R1's chat template opens the ``<think>``
  block in the prompt, so the answer may or may not repeat ``<think>``. The text up to
  ``</think>`` is reasoning (a leading ``<think>`` dropped), the rest content; an answer
  without ``</think>`` (cut by ``max_tokens``) is all reasoning. Also for models whose template
  opens the block the same way (Qwen3's thinking-only releases, QwQ).
- ``qwen3``: thinking is optional (``enable_thinking``). An answer that starts with
  ``<think>`` has its reasoning up to ``</think>``, the rest content; any other answer is all
  content (``reasoning`` None). A block never closed (cut by ``max_tokens``) is reasoning: vLLM's
  whole-text parse calls it content, but its stream has already sent it as reasoning by then;
  here both agree.
"""

from __future__ import annotations

import abc
from typing import ClassVar

__all__ = [
    "REASONING_FIELDS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser", "ThinkTagsReasoningParser",
]

#: The fields an answer's reasoning can be returned in (``rtpcore serve --reasoning-field``):
#: vLLM's current name, and its older one.
REASONING_FIELDS = ("reasoning", "reasoning_content")


class ReasoningParser(abc.ABC):
    """The base of every reasoning parser (the ``reasoning_parsers`` seam): ``name`` selects it
    (``--reasoning-parser``); ``api_version`` is the seam's version the class was written for;
    ``replaces`` the built-in parsers' names it takes over."""

    name: ClassVar[str]
    api_version: ClassVar[str] = "1.0"
    replaces: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def extract(self, text: str) -> tuple[str | None, str]:
        """The whole answer's ``(reasoning, content)``: reasoning None when it has none."""

    def feed(self, delta: str) -> tuple[str, str]:
        """The next piece of a streamed answer; returns the ``(reasoning, content)`` text that is
        certain now (either may be ""). The default holds everything until :meth:`finish`."""
        self.__dict__.setdefault("_pieces", []).append(delta)
        return "", ""

    def finish(self) -> tuple[str, str]:
        """The answer has ended: the ``(reasoning, content)`` text not returned yet."""
        reasoning, content = self.extract("".join(self.__dict__.pop("_pieces", [])))
        return reasoning or "", content


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkTagsReasoningParser(ReasoningParser):
    """Reasoning between ``start`` and ``end`` markers at the start of the answer (the base of
    both built-ins; a family with other markers subclasses it with its own). ``opened``: the
    chat template opened the block in the prompt, so the answer is reasoning from its first
    character, whether or not it repeats ``start``; else only an answer that starts with
    ``start`` has reasoning."""

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    opened: ClassVar[bool] = False

    def __init__(self) -> None:
        self._state = "lead"  # lead (the answer may still start with `start`), reasoning, content
        self._buffer = ""  # text held back: a possible start of a marker

    def extract(self, text: str) -> tuple[str | None, str]:
        if text.startswith(self.start):
            text = text[len(self.start):]
        elif not self.opened:
            return None, text
        reasoning, found, content = text.partition(self.end)
        return reasoning, content if found else ""

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._buffer + delta
        self._buffer = ""
        reasoning = content = ""
        if self._state == "lead":
            if len(text) < len(self.start) and self.start.startswith(text):
                self._buffer = text  # may still become `start`
                return "", ""
            if text.startswith(self.start):
                text = text[len(self.start):]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self.opened else "content"
        if self._state == "reasoning":
            before, found, after = text.partition(self.end)
            if found:
                self._state = "content"
                reasoning, text = before, after
            else:
                keep = _held(text, self.end)
                reasoning, self._buffer = text[:len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning" or (self._state == "lead" and self.opened):
            return rest, ""
        return "", rest


class DeepSeekR1ReasoningParser(ThinkTagsReasoningParser):
    """``deepseek_r1``: the template opened ``<think>``; all is reasoning up to ``</think>``."""

    name = "deepseek_r1"
    opened = True


class Qwen3ReasoningParser(ThinkTagsReasoningParser):
    """``qwen3``: reasoning only in a ``<think>`` block the answer opens with."""

    name = "qwen3"
