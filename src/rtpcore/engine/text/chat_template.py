"""A checkpoint's chat template, rendered as transformers renders it.

The template comes from ``chat_template.jinja`` in the checkpoint folder, else from
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
``{"name", "template"}`` of which ``"default"`` is used, ``"tool_use"`` when tools are
given and it exists). It renders in jinja2's immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a
``{% generation %}`` block that only outputs its body, the globals
``raise_exception(message)`` and ``strftime_now(format)``, and a ``tojson`` filter that
does not escape HTML and takes ``indent``, ``separators``, ``sort_keys`` and
``ensure_ascii`` (as ``json.dumps``). The template receives ``messages`` (keys whose
value is None dropped), ``tools``, ``documents``, ``add_generation_prompt`` and the
named special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...) as
strings — what ``transformers``' ``apply_chat_template(..., tokenize=False)`` passes.

The rendered text already holds the template's special tokens (its BOS, if any):
encode it with ``add_special_tokens=False``, as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from rtpcore.engine.text.tokenizer import read_tokenizer_config, special_tokens
from rtpcore.errors import ChatTemplateError, CheckpointError

__all__ = ["ChatTemplate"]

TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplate:
    """One checkpoint's chat template(s). Build it with :meth:`from_pretrained`, or from
    the template text and the special tokens the template may use."""

    def __init__(
        self,
        template: str | Mapping[str, str],
        *,
        special_tokens: Mapping[str, str] | None = None,
        checkpoint: Path | None = None,
    ):
        self.templates: dict[str, str] = {"default": template} if isinstance(template, str) else dict(template)
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.checkpoint = checkpoint
        if not self.templates:
            raise CheckpointError(f"checkpoint {str(checkpoint)!r}: its chat_template list is empty", path=checkpoint)
        for name, text in self.templates.items():
            try:
                _compile(text)
            except Exception as exc:  # jinja2.TemplateSyntaxError
                raise CheckpointError(
                    f"checkpoint {str(checkpoint)!r}: chat template {name!r} does not compile: {exc}", path=checkpoint
                ) from exc

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTemplate:
        """The chat template of the checkpoint folder ``path``.

        Raises :class:`~rtpcore.errors.CheckpointError` naming the checkpoint when it has
        neither ``chat_template.jinja`` nor a ``chat_template`` in ``tokenizer_config.json``.
        """
        path = Path(path)
        config = read_tokenizer_config(path)
        file = path / TEMPLATE_FILE
        source: str | dict[str, str]
        if file.is_file():
            source = file.read_text(encoding="utf-8")
        else:
            source = _config_templates(config.get("chat_template"), path)
        return cls(source, special_tokens=special_tokens(config), checkpoint=path)

    @property
    def default(self) -> str:
        """The text of the template used when no tools are given."""
        return self._choose(None)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text of ``messages`` (``[{"role": "user", "content": "Hi"}, ...]``).

        Extra keyword arguments reach the template as variables (``enable_thinking=False``,
        ``date_string=...``) and override special tokens of the same name. Raises
        :class:`~rtpcore.errors.ChatTemplateError` when the template rejects the messages.
        """
        import jinja2

        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise ChatTemplateError(f"messages must be a list of objects, got {type(messages).__name__}", checkpoint=self.checkpoint)
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(
                    f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}",
                    checkpoint=self.checkpoint,
                )
            chat.append({str(k): _plain(v) for k, v in message.items() if v is not None})
        variables = {**self.special_tokens, **{k: _plain(v) for k, v in kwargs.items()}}
        template = _compile(self._choose(tools))
        try:
            return str(template.render(
                messages=chat, tools=_plain(tools), documents=_plain(documents),
                add_generation_prompt=add_generation_prompt, **variables,
            ))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}", checkpoint=self.checkpoint) from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            raise ChatTemplateError(
                f"the chat template failed on the messages: {type(exc).__name__}: {exc}", checkpoint=self.checkpoint
            ) from exc

    def _choose(self, tools: object) -> str:
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise ChatTemplateError(
            f"checkpoint {str(self.checkpoint)!r} has chat templates {sorted(self.templates)!r} and none named 'default'",
            checkpoint=self.checkpoint,
        )

    def __repr__(self) -> str:
        return f"ChatTemplate(checkpoint={str(self.checkpoint)!r}, templates={sorted(self.templates)!r})"


def _config_templates(value: object, path: Path) -> str | dict[str, str]:
    """``tokenizer_config.json``'s ``chat_template``: a string or ``[{"name", "template"}]``."""
    if value is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no chat template: neither {TEMPLATE_FILE} nor a 'chat_template' "
            "in tokenizer_config.json", path=path,
        )
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise CheckpointError(
        f"{str(path / 'tokenizer_config.json')!r}: 'chat_template' must be a string or a list of "
        f"{{'name': str, 'template': str}}, got {type(value).__name__}", path=path / "tokenizer_config.json",
    )


def _plain(value: Any) -> Any:
    """JSON-like data only reaches the sandbox (pydantic models are dumped; other objects
    become an inert ``<TypeName>`` string)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, str):  # subclasses (enums ...) lose their methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Chat templates' ``tojson``: plain ``json.dumps``, no HTML escaping (jinja2's own escapes)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@cache
def _environment() -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (training templates mark the
        assistant's tokens with it): renders its body unchanged."""

        tags = {"generation"}  # noqa: RUF012 -- jinja2.ext.Extension declares `tags` a plain class attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    return _environment().from_string(source)
