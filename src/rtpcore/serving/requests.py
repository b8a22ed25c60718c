"""A validated request -> what the engine runs: its prompt (the chat template rendered by the
engine's text side), its grammar (response_format, tool calls) and its SamplingParams, each a
400 naming the field when it cannot be."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rtpcore.engine.sample.grammar import Grammar
from rtpcore.engine.sample.params import SamplingParams
from rtpcore.engine.text.prompts import RESERVED_TEMPLATE_KWARGS, Prompt
from rtpcore.errors import (
    ChatTemplateError,
    InvalidRequestError,
)
from rtpcore.serving.errors import ApiError
from rtpcore.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormat,
)
from rtpcore.serving.state import Served
from rtpcore.serving.tools import Tools

__all__ = [
    "body_grammar", "check_limits", "check_model", "check_text_needs", "format_grammar", "params_for", "render_chat",
    "render_messages", "tool_plan",
]

logger = logging.getLogger(__name__)


def format_grammar(served: Served, fmt: ResponseFormat | None) -> Grammar | None:
    """The grammar of ``response_format`` (runs in a worker thread); None for text."""
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return served.grammars().json_object()
        assert fmt.json_schema is not None
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
        return served.grammars().json_schema(schema, field="response_format")
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="response_format.json_schema.schema") from None


def body_grammar(served: Served, body: CompletionRequest | ChatCompletionRequest) -> Grammar | None:
    """The grammar of the request's ``structured_outputs`` or ``response_format`` (runs in a
    worker thread); None when neither constrains the output."""
    so = body.structured_outputs
    if so is None:
        return format_grammar(served, body.response_format)
    try:
        if so.choice is not None:
            return served.grammars().choice(so.choice)
        if so.regex is not None:
            return served.grammars().regex(so.regex)
        if so.grammar is not None:
            return served.grammars().lark(so.grammar)
        schema = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ApiError(400, f"structured_outputs.json: not JSON: {exc}", param="structured_outputs.json") from None
        return served.grammars().json_schema(schema, field="structured_outputs.json")
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=exc.field or "structured_outputs") from None


def tool_plan(served: Served, body: ChatCompletionRequest) -> tuple[Tools | None, Grammar | None]:
    """How the request's tools are answered, and the grammar that constrains the output to a
    call ("required" or a named function; runs in a worker thread)."""
    mode = body.tool_mode
    if mode is None:
        return None, None
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(400, "response_format cannot be combined with tool calls (tool_choice "
                            f"{body.tool_choice!r}); send one of them", param="response_format")
    if body.structured_outputs is not None and mode != "auto":
        raise ApiError(400, "structured_outputs cannot be combined with tool calls (tool_choice "
                            f"{body.tool_choice!r}); send one of them", param="structured_outputs")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    if mode == "auto":
        if served.tool_parser is None:
            raise ApiError(400, "tool_choice 'auto' needs a tool-call parser: start the server with "
                                "--tool-call-parser NAME (or send tool_choice 'required' or a named function)",
                           param="tool_choice")
        return Tools("auto", parser=served.tool_parser, tools=tools), None
    functions = {t.function.name: t.function for t in body.tools or ()}
    try:
        if mode == "named":
            assert isinstance(body.tool_choice, NamedToolChoice)
            name = body.tool_choice.function.name
            grammar = served.grammars().json_schema(_parameters(functions[name]), field="tools")
            return Tools("named", name=name, tools=tools), grammar
        calls = {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [n]}, "parameters": _parameters(f)},
             "required": ["name", "parameters"], "additionalProperties": False}
            for n, f in functions.items()
        ]}
        schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return Tools("required", tools=tools), served.grammars().json_schema(schema, field="tools")
    except InvalidRequestError as exc:
        raise ApiError(400, f"tools: a function's parameters are not a usable JSON schema: "
                            f"{str(exc).removeprefix('tools: ')}", param="tools") from None


def _parameters(function: Any) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def render_chat(served: Served, body: ChatCompletionRequest) -> Prompt:
    """The rendered conversation and its token ids (runs in a worker thread): the engine's
    own rendering (``TextSide.render_conversation``, as ``Engine.chat``)."""
    extra = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:  # the template reads it as a variable (gpt-oss's do)
        if "reasoning_effort" in extra:
            raise ApiError(400, "reasoning_effort is sent twice: as a field and in chat_template_kwargs; send one",
                           param="reasoning_effort")
        extra["reasoning_effort"] = body.reasoning_effort
    final = bool(body.continue_final_message)
    return render_messages(
        served, body.messages,
        add_generation_prompt=body.add_generation_prompt if body.add_generation_prompt is not None else not final,
        continue_final_message=final,
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        template_kwargs=extra, reserved_in=body.chat_template_kwargs or {},
    )


def render_messages(served: Served, messages: Sequence[ChatMessage], *, add_generation_prompt: bool,
                    continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any], reserved_in: Mapping[str, Any],
                    check_length: bool = True) -> Prompt:
    """``messages`` rendered by the chat template and encoded (/v1/chat/completions, /tokenize),
    each refusal a 400 naming its field: no template, a variable of ``reserved_in`` (the
    client's ``chat_template_kwargs``) the request sets itself, the template's own failure, and
    (``check_length``) a rendered text certain to be over max_model_len tokens, unencoded."""
    if not served.has_chat_template:
        raise ApiError(400, "this model has no chat template (chat_template.jinja or tokenizer_config.json's "
                            "chat_template); use /v1/completions", param="messages")
    reserved = [k for k in reserved_in if k in RESERVED_TEMPLATE_KWARGS]
    if reserved:
        raise ApiError(400, f"chat_template_kwargs: {reserved[0]!r} is set by the request itself, not here",
                       param="chat_template_kwargs")
    try:
        return served.text.render_conversation(
            [m.for_template() for m in messages], add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, template_kwargs=template_kwargs,
            check_length=check_length,
        )
    except ChatTemplateError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from None
    except InvalidRequestError as exc:
        raise ApiError.invalid_request(exc) from None


def check_limits(served: Served, body: CompletionRequest | ChatCompletionRequest) -> None:
    """The caps of ``served.limits`` (docs/design.md §17): a 400 naming the field and the cap
    (and the flag that raises it), before anything is compiled or run."""
    limits = served.limits
    counts = [
        ("logit_bias", len(body.logit_bias or {}), limits.max_logit_bias, "--max-logit-bias", "entries"),
        ("stop", len(body.stop_strings), limits.max_stop_strings, "--max-stop-strings", "strings"),
        ("stop_token_ids", len(body.stop_token_ids or ()), limits.max_stop_token_ids, "--max-stop-token-ids", "ids"),
        ("n", body.num_choices, limits.max_n, "--max-n", "choices"),
    ]
    tools = getattr(body, "tools", None) or ()
    counts.append(("tools", len(tools), limits.max_tools, "--max-tools", "tools"))
    for field, count, cap, flag, what in counts:
        if count > cap:
            raise ApiError(400, f"{field}: at most {cap} {what} on this server ({flag}), got {count}", param=field)
    schemas = [("tools", t.function.parameters) for t in tools if t.function.parameters is not None]
    fmt = body.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        schemas.append(("response_format", fmt.json_schema.schema_))
    for field, schema in schemas:
        size = len(json.dumps(schema, separators=(",", ":")).encode())
        if size > limits.max_schema_bytes:
            raise ApiError(400, f"{field}: a schema of {size} bytes is over this server's limit of "
                                f"{limits.max_schema_bytes} (--max-schema-bytes)", param=field)


def check_text_needs(served: Served, body: CompletionRequest | ChatCompletionRequest) -> None:
    """On a server without a tokenizer (``--skip-tokenizer-init``), a 400 naming the first
    field of ``body`` that needs one; nothing otherwise."""
    if served.tokenizer is not None:
        return
    chat = isinstance(body, ChatCompletionRequest)
    wants = [
        ("chat completions", "messages", chat),
        ("a text prompt", "prompt", isinstance(getattr(body, "prompt", None), str)),
        ("stop strings", "stop", bool(body.stop_strings)),
        ("logprobs", "logprobs", body._logprobs() is not None),
        ("response_format", "response_format", body.response_format is not None and body.response_format.type != "text"),
        ("structured_outputs", "structured_outputs", body.structured_outputs is not None),
    ]
    for what, param, wanted in wants:
        if wanted:
            served.require_tokenizer(what, param)


def check_model(served: Served, model: str) -> None:
    if model != served.model_name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {served.model_name!r}",
                       param="model", code="model_not_found")


def params_for(served: Served, body: CompletionRequest | ChatCompletionRequest, prompt: Prompt,
               grammar: Grammar | None = None) -> SamplingParams:
    """The request's SamplingParams (``body.to_sampling_params``) within this model's limits,
    its ``vllm_xargs`` taken by the engine's logits processors (a 400 naming ``vllm_xargs``)."""
    try:
        params = body.to_sampling_params(len(prompt.token_ids), max_model_len=served.max_model_len,
                                         vocab_size=served.vocab_size, grammar=grammar)
        served.engine.engine.check_extra_args(params, field="vllm_xargs")
    except InvalidRequestError as exc:
        raise ApiError.invalid_request(exc) from None
    return params
