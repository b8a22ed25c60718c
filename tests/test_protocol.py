"""A request of the OpenAI-compatible API converts itself into the engine's SamplingParams
(``to_sampling_params``): every honoured field reaches its setting, OpenAI's defaults fill the
absent ones, and what cannot run is an InvalidRequestError naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from rtpcore.engine.sample.params import SamplingParams
from rtpcore.errors import InvalidRequestError
from rtpcore.serving.protocol import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "Hi"}]
EVERY_FIELD: dict[str, Any] = {
    "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 11, "stop": ["\n\n", "END"],
    "stop_token_ids": [7, 9], "n": 3, "frequency_penalty": 0.5, "presence_penalty": -0.25,
    "repetition_penalty": 1.2, "logit_bias": {"5": -100, "12": 2.5}, "min_tokens": 2, "ignore_eos": True,
    "include_stop_str_in_output": True, "skip_special_tokens": False,
}


class Grammar:
    """Stands for a compiled grammar: SamplingParams takes anything with a ``state()``."""

    def state(self) -> None:
        return None


def mapped(params: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
        "seed": params.seed, "stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids), "n": params.n,
        "frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": {str(k): v for k, v in params.logit_bias}, "min_tokens": params.min_tokens,
        "ignore_eos": params.ignore_eos, "include_stop_str_in_output": params.include_stop_str_in_output,
        "skip_special_tokens": params.skip_special_tokens,
    }


@pytest.mark.parametrize("chat", [False, True])
def test_every_sampling_field_reaches_its_setting(chat: bool) -> None:
    """Each honoured field of completions and chat lands in the SamplingParams field of its name,
    with the grammar given and the token limit asked."""
    grammar = Grammar()
    if chat:
        body: CompletionRequest | ChatCompletionRequest = ChatCompletionRequest(
            model="m", messages=USER, max_completion_tokens=20, logprobs=True, top_logprobs=4, **EVERY_FIELD)
    else:
        body = CompletionRequest(model="m", prompt="Hi", max_tokens=20, logprobs=4, **EVERY_FIELD)
    params = body.to_sampling_params(5, max_model_len=64, vocab_size=100, grammar=grammar)
    assert mapped(params) == {**EVERY_FIELD, "logit_bias": {"5": -100.0, "12": 2.5}}
    assert params.max_tokens == 20 and params.logprobs == 4 and params.grammar is grammar


def test_absent_fields_take_openais_defaults() -> None:
    """Nothing set: temperature 1, no truncation, no penalties; completions run 16 tokens, chat the rest
    of the context; logprobs None; one choice; special tokens skipped, stop strings cut."""
    completion = CompletionRequest(model="m", prompt=[1, 2]).to_sampling_params(2, max_model_len=64)
    chat = ChatCompletionRequest(model="m", messages=USER).to_sampling_params(10, max_model_len=64)
    for params, limit in ((completion, 16), (chat, 54)):
        assert params == SamplingParams(max_tokens=limit, temperature=1.0)
    assert ChatCompletionRequest(model="m", messages=USER).to_sampling_params(63, max_model_len=64).max_tokens == 1


@pytest.mark.parametrize(("fields", "want"), [
    ({"top_k": -1, "top_p": 1.0}, (None, None)),
    ({"top_k": 0, "top_p": 0.5}, (None, 0.5)),
    ({"top_k": 3}, (3, None)),
])
def test_switched_off_truncation_is_none(fields: dict[str, Any], want: tuple[Any, Any]) -> None:
    """top_k -1 or 0 and top_p 1 switch truncation off, as vLLM reads them."""
    params = CompletionRequest(model="m", prompt="x", **fields).to_sampling_params(1, max_model_len=64)
    assert (params.top_k, params.top_p) == want


def test_chat_logprobs_count_the_top_alternatives() -> None:
    """Chat's logprobs=true asks for the chosen token's (0 alternatives) unless top_logprobs says more;
    false asks for none."""
    def logprobs(**fields: Any) -> int | None:
        return ChatCompletionRequest(model="m", messages=USER, **fields).to_sampling_params(
            1, max_model_len=64).logprobs

    assert (logprobs(logprobs=True), logprobs(logprobs=True, top_logprobs=3), logprobs(logprobs=False)) == (0, 3, None)


@pytest.mark.parametrize(("body", "prompt_len", "field", "message"), [
    (CompletionRequest(model="m", prompt="x"), 0, "prompt", "the prompt encodes to no tokens"),
    (ChatCompletionRequest(model="m", messages=USER), 0, "messages", "the prompt encodes to no tokens"),
    (CompletionRequest(model="m", prompt="x", max_tokens=60), 10, "max_tokens",
     "This model's maximum context length is 64 tokens (max_model_len); the prompt has 10 tokens and "
     "max_tokens=60 asks for 60 more (70 in all): shorten the prompt or lower max_tokens"),
    (ChatCompletionRequest(model="m", messages=USER, max_tokens=5, max_completion_tokens=60), 10,
     "max_completion_tokens", "This model's maximum context length is 64 tokens (max_model_len); the prompt has "
     "10 tokens and max_completion_tokens=60 asks for 60 more (70 in all): shorten the prompt or lower "
     "max_completion_tokens"),
    (CompletionRequest(model="m", prompt="x", logit_bias={"3": 1, "100": 1}), 1, "logit_bias",
     "logit_bias: token id 100 is not below the vocabulary size 100"),
    (ChatCompletionRequest(model="m", messages=USER, stop_token_ids=[250]), 1, "stop_token_ids",
     "stop_token_ids: token id 250 is not below the vocabulary size 100"),
    (CompletionRequest(model="m", prompt="x", seed=1 << 70), 1, "seed", None),
])
def test_what_cannot_run_names_the_field(body: Any, prompt_len: int, field: str, message: str | None) -> None:
    """An empty prompt, a request past the context, token ids outside the vocabulary and values the
    engine refuses raise InvalidRequestError naming the field (the server's 400 ``param``)."""
    with pytest.raises(InvalidRequestError) as excinfo:
        body.to_sampling_params(prompt_len, max_model_len=64, vocab_size=100)
    assert excinfo.value.field == field
    if message is not None:
        assert str(excinfo.value) == message
    code = excinfo.value.code
    assert code == ("context_length_exceeded" if "context length" in str(excinfo.value) else None)
