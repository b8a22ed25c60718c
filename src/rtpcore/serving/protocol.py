"""Request and response shapes of the OpenAI-compatible API (docs/design.md §8, §15).

Requests are pydantic models mirroring OpenAI's (and vLLM's extensions). Every field is one
of three kinds, and nothing is silently ignored:

* **honoured**: wired to the engine or the text layer (``FIELDS`` lists them per endpoint);
* **accepted without effect**: ``user``, ``metadata``, ``store``, ``service_tier``
  (bookkeeping fields of OpenAI's platform);
* **refused**: any other field, and any value rtpcore cannot honour (``best_of`` > 1,
  ``suffix``, ``echo``, image or audio parts, ...) is a 400 naming the field.

``null`` means "absent" for every field OpenAI marks nullable (several SDKs and proxies send
explicit nulls), so every optional field here takes None and the defaults live in the
properties that read them. A malformed or out-of-range value fails validation and the server
answers 400 naming it (``param``).

A request converts itself into the engine's settings: ``to_sampling_params(prompt_len, ...)``
gives the :class:`~rtpcore.engine.sample.params.SamplingParams` that ``Engine.generate`` would
take for the same request (``n``, stop strings and the text options included), checked against
the model's limits it is given; what it cannot honour raises an
:class:`~rtpcore.errors.InvalidRequestError` naming the field.
"""

from __future__ import annotations

import json
import typing
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rtpcore.engine.sample.params import SamplingParams
from rtpcore.errors import InvalidRequestError
from rtpcore.serving.json_body import lone_surrogate

if TYPE_CHECKING:
    from rtpcore.engine.sample.grammar import Grammar

__all__ = [
    "ACCEPTED_WITHOUT_EFFECT",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "MAX_LOGPROBS",
    "MAX_MESSAGES",
    "MAX_STOP_LENGTH",
    "MESSAGE_ROLES",
    "TEMPLATE_AS_SENT",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "ErrorBody",
    "StreamOptions",
    "StructuredOutputs",
    "TokenizeRequest",
    "lone_surrogate",
]

MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit)
MAX_STOP_LENGTH = 1024  # characters of one stop string: each is searched in every new piece of text
MAX_MESSAGES = 4096  # messages of one chat request
ACCEPTED_WITHOUT_EFFECT = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the default of OpenAI for /v1/completions


class _Strict(BaseModel):
    """Unknown fields are refused (a 400 naming the field), never dropped."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels: accepted, none added


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`` (docs/design.md §16)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema: {name, schema}")
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of ``choice`` (one of these strings),
    ``regex`` (text matching it whole), ``json`` (a JSON schema, or its JSON text) and
    ``grammar`` (a Lark grammar, llguidance's dialect), honoured as ``response_format`` is."""

    choice: list[str] | None = None
    regex: str | None = None
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    grammar: str | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [k for k, v in (("choice", self.choice), ("regex", self.regex), ("json", self.json_),
                                ("grammar", self.grammar)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"send exactly one of choice, regex, json, grammar; got {', '.join(given) or 'none'}")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Strict):
    """The fields completions and chat share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 and 0 switch it off, as vLLM reads them
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)  # at most the server's --max-n (requests.check_limits)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)  # docs/design.md §22
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None  # vLLM's: run to max_tokens past the model's stop tokens
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's

    @model_validator(mode="after")
    def _one_constraint(self) -> _Sampling:
        fmt = self.response_format
        if self.structured_outputs is not None and fmt is not None and fmt.type != "text":
            raise ValueError("structured_outputs and response_format both constrain the output: send one")
        return self
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = None  # vLLM's: each choice (and chunk) also carries its token_ids
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: prefix-cache blocks shared per salt
    vllm_xargs: dict[str, Any] | None = None  # vLLM's: the logits processors' per-request arguments (extra_args)
    # Accepted without effect (OpenAI platform bookkeeping; prompt_cache_key is a routing hint).
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    modalities: list[str] | None = None  # only ["text"]: this server writes text

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, modalities: list[str] | None) -> list[str] | None:
        other = [m for m in modalities or () if m != "text"]
        if other:
            raise ValueError(f"this server writes text only; {other[0]!r} is not among its outputs: send [\"text\"]")
        return modalities

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if any(s == "" for s in strings):
            raise ValueError("a stop string must not be empty")
        if any(len(s) > MAX_STOP_LENGTH for s in strings):
            raise ValueError(f"a stop string may hold at most {MAX_STOP_LENGTH} characters")
        return stop

    @field_validator("vllm_xargs")
    @classmethod
    def _xargs(cls, xargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if xargs is not None:
            try:
                json.dumps(xargs, allow_nan=False)
            except ValueError as exc:
                raise ValueError(f"a JSON object of JSON values: {exc}") from None
        return xargs

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids and any(t < 0 for t in ids):
            raise ValueError("token ids must be >= 0")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()):  # str.isdigit alone takes "²", which int() refuses
                raise ValueError(f"keys are token ids (strings of ASCII decimal digits), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {value}")
        return bias

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    #: The field an empty prompt's error names.
    prompt_field: ClassVar[str] = "prompt"

    def _limit(self, prompt_len: int, max_model_len: int) -> tuple[str, int]:
        """The field that sets the most new tokens, and their number."""
        raise NotImplementedError

    def _logprobs(self) -> int | None:
        """Top log-probabilities per token, None for none."""
        raise NotImplementedError

    def to_sampling_params(self, prompt_len: int, *, max_model_len: int, vocab_size: int | None = None,
                           grammar: Grammar | None = None) -> SamplingParams:
        """The engine's settings for this request and a prompt of ``prompt_len`` tokens:
        OpenAI's defaults where a field is absent (``temperature`` 1; ``max_tokens`` 16 on
        completions, the rest of ``max_model_len`` on chat), ``grammar`` the output follows
        (``response_format`` or tool calls, compiled by the caller). Token ids are checked
        against ``vocab_size`` (None: unchecked); the prompt plus the new tokens must fit
        ``max_model_len``. Raises :class:`~rtpcore.errors.InvalidRequestError` naming the field
        (``code`` "context_length_exceeded" for a request too long)."""
        if prompt_len < 1:
            raise InvalidRequestError("the prompt encodes to no tokens", field=self.prompt_field, value=prompt_len)
        field, limit = self._limit(prompt_len, max_model_len)
        if prompt_len + limit > max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens (max_model_len); the prompt has "
                f"{prompt_len} tokens and {field}={limit} asks for {limit} more ({prompt_len + limit} in all): "
                f"shorten the prompt or lower {field}", field=field, value=limit, code="context_length_exceeded",
            )
        for name, tokens in (("logit_bias", [int(k) for k in self.logit_bias or {}]),
                             ("stop_token_ids", self.stop_token_ids or [])):
            if vocab_size is not None and tokens and max(tokens) >= vocab_size:
                raise InvalidRequestError(f"{name}: token id {max(tokens)} is not below the vocabulary size {vocab_size}",
                                          field=name, value=max(tokens))
        return SamplingParams(
            max_tokens=limit,
            temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            top_k=self.top_k if self.top_k not in (None, -1, 0) else None,
            top_p=self.top_p if self.top_p not in (None, 1.0) else None,
            min_p=self.min_p, seed=self.seed, logprobs=self._logprobs(),
            stop=self.stop_strings, stop_token_ids=self.stop_token_ids or (), ignore_eos=bool(self.ignore_eos),
            logit_bias=self.logit_bias, min_tokens=self.min_tokens or 0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            grammar=grammar, n=self.num_choices,
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            cache_salt=self.cache_salt, extra_args=self.vllm_xargs,
        )


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: str | list[int]) -> str | list[int]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            raise ValueError("token ids must be >= 0")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo is not supported; send false or leave it out")
        return echo

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("best_of is not supported (only 1); ask for n choices instead")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (insertion) is not supported")
        return suffix

    def _limit(self, prompt_len: int, max_model_len: int) -> tuple[str, int]:
        return "max_tokens", self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS

    def _logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    """One message. Fields beyond ``role`` and ``content`` (``name``, ``tool_calls``,
    ``tool_call_id``, ...) are handed to the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # An earlier answer's reasoning (docs/design.md §17, "Reasoning"): vLLM's current name and
    # its older one; the chat template receives it as reasoning_content.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _one_reasoning(self) -> ChatMessage:
        if self.reasoning is not None and self.reasoning_content is not None and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content are two names of one field: send one")
        return self

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(
                        f"part {j} is of type {kind!r}: this model reads text only (image, audio and file parts "
                        "are not supported)"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {j}: a text part needs a string 'text'")
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it; text parts of a list content joined."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(str(p["text"]) for p in self.content)
        reasoning = out.pop("reasoning", None)
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out


#: The roles a message may have.
MESSAGE_ROLES: tuple[str, ...] = typing.get_args(ChatMessage.model_fields["role"].annotation)
#: Message fields that reach the chat template as sent when they are strings (``content`` also
#: as a list of text parts, joined): what :meth:`ChatMessage.for_template` does to them, and
#: what the body parser's worker may render without the server (rtpcore.serving.json_body).
TEMPLATE_AS_SENT: tuple[str, ...] = ("role", "content", "name")


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None  # at most the server's --max-tools (requests.check_limits)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # to the chat template

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: send add_generation_prompt=false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        if (choice in ("auto", "required") or isinstance(choice, NamedToolChoice)) and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                             f"tools ({', '.join(names)})")
        return self

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or ``"none"``), ``"auto"``, ``"required"`` or ``"named"``."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"  # OpenAI's default with tools

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    prompt_field: ClassVar[str] = "messages"

    def _limit(self, prompt_len: int, max_model_len: int) -> tuple[str, int]:
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        limit = self.token_limit
        return field, limit if limit is not None else max(1, max_model_len - prompt_len)  # chat may run to max_model_len

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): ``prompt`` encoded as /v1/completions encodes it, or
    ``messages`` rendered by the chat template as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: true for a prompt; a template writes its own
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)

    @field_validator("tokens")
    @classmethod
    def _ids(cls, tokens: list[int]) -> list[int]:
        if any(t < 0 for t in tokens):
            raise ValueError("token ids must be >= 0")
        return tokens


class ErrorBody(BaseModel):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None

    def wrap(self) -> dict[str, Any]:
        return {"error": self.model_dump()}
