"""The input side of the offline API: the forms a prompt takes, and the checkpoint's text
side (its tokenizer and chat template, loaded once per engine on first use).

A prompt is a string, a sequence of token ids, ``{"prompt": str}`` or
``{"prompt_token_ids": [...]}`` (vLLM's ``TextPrompt`` and ``TokensPrompt``); a call takes
one prompt or a list of them. :class:`TextSide` is the engine's text side (``Engine.text``),
which ``rtpcore serve`` holds too: text is encoded with ``add_special_tokens=True`` (the
checkpoint's BOS rule applies) by :meth:`TextSide.encode`, for ``Engine.generate`` and a
completion's prompt alike; a conversation is rendered with the chat template and encoded
without adding special tokens (the template wrote them) by
:meth:`TextSide.render_conversation`, for ``Engine.chat`` and ``/v1/chat/completions`` alike.
Every bad input is an :class:`~rtpcore.errors.InvalidRequestError` naming the argument.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from rtpcore.engine.text.chat_template import TEMPLATE_FILE, ChatTemplate
from rtpcore.engine.text.tokenizer import Tokenizer, has_tokenizer, read_tokenizer_config
from rtpcore.errors import ChatTemplateError, InvalidRequestError

__all__ = ["RESERVED_TEMPLATE_KWARGS", "Prompt", "PromptInputs", "PromptType", "TextSide", "conversations", "prompt_items"]

#: Template variables a chat sets itself, refused in ``chat_template_kwargs`` (as the server does).
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tools", "documents")
_PROMPT_KEYS = ("prompt", "prompt_token_ids")

#: One prompt: text, token ids, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``.
PromptType = str | Sequence[int] | Mapping[str, Any]
#: What a call takes: one prompt or a list of them.
PromptInputs = PromptType | Sequence[PromptType]


@attrs.frozen
class Prompt:
    """One prompt as the model reads it: ``token_ids``, and the ``text`` they came from (None
    for a token-id prompt)."""

    text: str | None
    token_ids: tuple[int, ...]


def _is_token_ids(value: Any) -> bool:
    """A non-empty sequence of ints: one token-id prompt (not a list of prompts)."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence) or not value:
        return False
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one(value: Any, name: str) -> str | list[int]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in _PROMPT_KEYS]
        given = [k for k in _PROMPT_KEYS if k in value]
        if unknown or len(given) != 1:
            raise InvalidRequestError(
                f"{name} must hold exactly one of 'prompt' (text) or 'prompt_token_ids', got the keys "
                f"{sorted(map(str, value))!r}", field="prompts", value=value,
            )
        value = value[given[0]]
        if given[0] == "prompt" and not isinstance(value, str):
            raise InvalidRequestError(f"{name}['prompt'] must be a string, got {type(value).__name__}",
                                      field="prompts", value=value)
        if given[0] == "prompt_token_ids":
            if isinstance(value, torch.Tensor):
                value = value.tolist()
            if isinstance(value, str | bytes) or not isinstance(value, Sequence):
                raise InvalidRequestError(f"{name}['prompt_token_ids'] must be a sequence of token ids, got "
                                          f"{type(value).__name__}", field="prompts", value=value)
            return list(value)  # checked by the core (empty, ids outside the vocabulary)
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and not isinstance(value, bytes) and (_is_token_ids(value) or not value):
        return list(value)
    raise InvalidRequestError(
        f"{name} must be a string, a sequence of token ids, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
        f"got {type(value).__name__}", field="prompts", value=value,
    )


def prompt_items(prompts: Any) -> list[str | list[int]]:
    """The prompts of one call, each text or token ids. ``prompts`` is one prompt (a string,
    a token-id sequence, a dict) or a list of them; an empty list is no prompt."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if isinstance(prompts, str | Mapping) or _is_token_ids(prompts):
        return [_one(prompts, "prompt 0")]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise InvalidRequestError(
            f"prompts must be a prompt (a string, token ids or a dict) or a list of them, got {type(prompts).__name__}",
            field="prompts", value=prompts,
        )
    return [_one(p, f"prompt {i}") for i, p in enumerate(prompts)]


def conversations(messages: Any) -> list[list[Mapping[str, Any]]]:
    """``messages`` as a list of conversations: one conversation (a list of message dicts) or
    a list of them. Text parts of a list ``content`` are joined (as the server joins them)."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(
            "messages must be a conversation (a non-empty list of {'role', 'content'} dicts) or a list of them, "
            f"got {messages!r:.80}", field="messages", value=messages,
        )
    convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
    out = []
    for i, conv in enumerate(convs):
        if isinstance(conv, str | bytes | Mapping) or not isinstance(conv, Sequence) or not conv:
            raise InvalidRequestError(f"conversation {i} must be a non-empty list of message dicts, got {conv!r:.80}",
                                      field="messages", value=conv)
        out.append([_message(m, i, j) for j, m in enumerate(conv)])
    return out


def _message(message: Any, i: int, j: int) -> Mapping[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"conversation {i}, message {j} must be a dict with 'role' and 'content', got "
                                  f"{type(message).__name__}", field="messages", value=message)
    content = message.get("content")
    if isinstance(content, list):
        for k, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"conversation {i}, message {j}, content part {k}: only text parts "
                    "({'type': 'text', 'text': str}) are supported", field="messages", value=part,
                )
        return {**message, "content": "".join(str(p["text"]) for p in content)}
    return message


_UNSET: Any = object()


class TextSide:
    """The tokenizer and chat template of the checkpoint at ``path``, each loaded on first use
    (once; thread-safe). ``eos_token_ids``: the engine's stop ids, to which each request adds
    the tokenizer's ``eos_token`` (:attr:`tokenizer_eos`; ``output_processor.PromptRun`` does,
    offline and on the server)."""

    def __init__(self, path: str | Path, eos_token_ids: Sequence[int], max_model_len: int | None = None):
        self.path = Path(path)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len  # texts certain to encode past it are refused unencoded (check_length)
        self._lock = threading.Lock()
        self._tokenizer: Any = _UNSET
        self._template: Any = _UNSET

    def without_tokenizer(self) -> TextSide:
        """This text side with neither tokenizer nor chat template, however the checkpoint
        has them: prompts are token ids and outputs have no text (``rtpcore serve
        --skip-tokenizer-init``)."""
        side = TextSide(self.path, self.eos_token_ids, self.max_model_len)
        side._tokenizer = None
        side._template = None
        return side

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer; None when it has no ``tokenizer.json``."""
        with self._lock:
            if self._tokenizer is _UNSET:
                has = has_tokenizer(self.path)
                self._tokenizer = Tokenizer.from_pretrained(self.path) if has else None
            return self._tokenizer

    @property
    def tokenizer_eos(self) -> tuple[int, ...]:
        """The tokenizer's ``eos_token`` id when the engine's stop ids lack it (docs/design.md
        §15: some checkpoints name it nowhere else), else ()."""
        tok = self.tokenizer
        eos = tok.eos_token_id if tok is not None else None
        return () if eos is None or eos in self.eos_token_ids else (eos,)

    def require_tokenizer(self, what: str, field: str) -> Tokenizer:
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError(
                f"{what} needs the checkpoint's tokenizer, {str(self.path / 'tokenizer.json')!r}, which is missing",
                field=field,
            )
        return tok

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint has a chat template (loading it, the first time)."""
        return self._load_template() is not None

    def _load_template(self) -> ChatTemplate | None:
        with self._lock:
            if self._template is _UNSET:
                has = (self.path / TEMPLATE_FILE).is_file() or "chat_template" in read_tokenizer_config(self.path)
                self._template = ChatTemplate.from_pretrained(self.path) if has else None
            template: ChatTemplate | None = self._template
            return template

    def chat_template(self) -> ChatTemplate:
        template = self._load_template()
        if template is None:
            raise InvalidRequestError(
                f"checkpoint {str(self.path)!r} has no chat template ({TEMPLATE_FILE} or tokenizer_config.json's "
                "chat_template); use generate", field="messages",
            )
        return template

    def encode(self, items: Sequence[str | list[int]], *, field: str = "prompts") -> list[Prompt]:
        """Each item as a :class:`Prompt`: text encoded with the checkpoint's BOS rule. A text
        certain to encode past ``max_model_len`` tokens is refused before it is encoded
        (:meth:`check_length`; ``field`` names it)."""
        out = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                tok = self.tokenizer
                if tok is None:  # the message of the token-id-only engine, which predates text prompts
                    raise InvalidRequestError(
                        f"prompt {i} must be a sequence of token ids: it is text, and the checkpoint has no "
                        f"tokenizer ({str(self.path / 'tokenizer.json')!r} is missing) to encode it",
                        field="prompts", value=item,
                    )
                self.check_length(item, field, "prompt" if len(items) == 1 else f"prompt {i}")
                out.append(Prompt(item, tuple(tok.encode(item, add_special_tokens=True))))
            else:
                out.append(Prompt(None, tuple(item)))
        return out

    def render(
        self,
        convs: Sequence[Sequence[Mapping[str, Any]]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[Prompt]:
        """Each conversation rendered by the chat template and encoded (no special tokens
        added: the template wrote them)."""
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequestError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}",
                                      field="add_generation_prompt", value=add_generation_prompt)
        extra = _template_kwargs(chat_template_kwargs)
        if tools is not None and (isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence)
                                  or not all(isinstance(t, Mapping) for t in tools)):
            raise InvalidRequestError(f"tools must be a list of tool dicts, got {tools!r:.80}", field="tools", value=tools)
        self.chat_template()
        self.require_tokenizer("chat", "messages")
        out = []
        for i, conv in enumerate(convs):
            try:
                out.append(self.render_conversation(conv, add_generation_prompt=add_generation_prompt, tools=tools,
                                                    template_kwargs=extra))
            except ChatTemplateError as exc:
                raise InvalidRequestError(f"messages (conversation {i}): {exc}", field="messages") from exc
        return out

    def render_conversation(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        check_length: bool = True,
    ) -> Prompt:
        """One conversation rendered by the chat template (``tools`` and ``template_kwargs``
        reach it; the caller keeps :data:`RESERVED_TEMPLATE_KWARGS` out of the latter) and
        encoded without adding special tokens (the template wrote them): what :meth:`render`
        and ``/v1/chat/completions`` run. ``continue_final_message``: the text ends with the
        last message's content, cut before what the template closes it with, so that the model
        continues it. ``check_length``: a rendered text certain to encode past ``max_model_len``
        tokens is refused before it is encoded (:meth:`check_length`, field ``messages``; False
        for a caller that only counts tokens). The template's own failure is a
        :class:`~rtpcore.errors.ChatTemplateError` (the caller says which conversation); no
        template, no tokenizer, or a template that does not write the last message's content
        verbatim is an InvalidRequestError naming the field."""
        template = self.chat_template()
        tok = self.require_tokenizer("chat", "messages")
        text = template.render(messages, add_generation_prompt=add_generation_prompt,
                               tools=list(tools) if tools else None, **dict(template_kwargs or {}))
        if continue_final_message:
            content = str(messages[-1].get("content") or "")
            end = text.rfind(content) if content else -1
            if end < 0:
                raise InvalidRequestError("continue_final_message: the chat template does not render the last "
                                          "message's content verbatim", field="continue_final_message")
            text = text[: end + len(content)]
        if check_length:
            self.check_length(text, "messages", "rendered conversation")
        return Prompt(text, tuple(tok.encode(text, add_special_tokens=False)))

    def check_length(self, text: str, field: str, what: str = "prompt") -> None:
        """Refuse, before it is encoded, a text that encodes to more than ``max_model_len``
        tokens however it is split: its characters divided by the most characters one token
        stands for (:attr:`Tokenizer.max_chars_per_token
        <rtpcore.engine.text.tokenizer.Tokenizer.max_chars_per_token>`, computed once per
        tokenizer) already exceed ``max_model_len``. An InvalidRequestError naming ``field``
        (``code`` "context_length_exceeded"); nothing when no bound holds for the tokenizer, or
        without ``max_model_len``. Encoding megabytes of text costs seconds of CPU, and such a
        prompt would be refused once encoded."""
        problem = self.length_problem(len(text), field, what)
        if problem is not None:
            raise problem

    def length_problem(self, chars: int, field: str, what: str = "prompt") -> InvalidRequestError | None:
        """The refusal :meth:`check_length` raises for a text of ``chars`` characters, or None
        when such a text may fit (a caller that measured the text elsewhere: the body parser's
        process, rtpcore.serving.json_body)."""
        tok = self.tokenizer
        limit = self.max_model_len
        per_token = tok.max_chars_per_token if tok is not None else None
        if limit is None or per_token is None or chars <= per_token * limit:
            return None
        at_least = -(-chars // per_token)
        return InvalidRequestError(
            f"This model's maximum context length is {limit} tokens (max_model_len), and the {what} of "
            f"{chars} characters is at least {at_least} tokens (no token of this tokenizer stands for more "
            f"than {per_token} characters): shorten it", field=field, value=chars, code="context_length_exceeded",
        )


def _template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidRequestError(f"chat_template_kwargs must be a dict of names to values, got {value!r:.80}",
                                  field="chat_template_kwargs", value=value)
    reserved = [k for k in value if k in RESERVED_TEMPLATE_KWARGS]
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs: {reserved[0]!r} is set by the call itself, not here",
                                  field="chat_template_kwargs", value=value)
    return dict(value)
