"""The offline API (``Engine.generate(prompts, sampling_params)``, ``Engine.chat``,
``AsyncEngine.generate``) on a real tiny checkpoint with a real tokenizer: the token-id form's
tokens, stop strings, stop ids added to the end-of-sequence ids, ``n`` sequences, logprob sums,
cumulative async outputs, errors naming the argument -- and, against a live ``rtpcore serve``
process, the server's text and token counts for the same requests."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from rtpcore import AsyncEngine, CompletionOutput, Engine, GenerationOutput, SamplingParams  # noqa: E402
from rtpcore.engine.text.tokenizer import Tokenizer  # noqa: E402
from rtpcore.errors import InvalidRequestError  # noqa: E402
from test_llama import make_checkpoint  # noqa: E402
from test_serve import Server, write_tokenizer  # noqa: E402

TIMEOUT = 300.0  # a bound against hanging, never a speed requirement
IDS = [1, 40, 41, 42, 43, 44, 45]
TEXT = "The capital of France is"
CHAT = [{"role": "user", "content": "Hello, world!"}]
FORCED = 70  # a token logit_bias makes certain
EOS = 2  # "</s>", config.json's eos_token_id and the tokenizer's eos_token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("offline")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=256)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(checkpoint) as e:
        yield e


@pytest.fixture(scope="module")
def tok(checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(checkpoint)


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def one(engine: Engine, prompt: Any, params: SamplingParams) -> CompletionOutput:
    (out,) = engine.generate(prompt, params)
    assert out.finished and len(out.outputs) == 1
    return out.outputs[0]


def shown(tok: Tokenizer, ids: tuple[int, ...] | list[int]) -> str:
    """The text of ``ids`` as the API shows it: a final end-of-sequence token is not text."""
    return tok.decode(list(ids[:-1]) if ids and ids[-1] == EOS else list(ids))


def test_greedy_outputs_are_the_token_id_forms_tokens_with_their_text(engine: Engine, tok: Tokenizer) -> None:
    """The outputs form gives the token-id form's tokens for the same prompt, the text they decode
    to, finish "length" at max_tokens; a text prompt is encoded with the checkpoint's BOS rule."""
    want = engine.generate([IDS], max_new_tokens=12)[0]
    out = engine.generate([IDS], greedy())[0]
    assert isinstance(out, GenerationOutput) and out.prompt is None and out.prompt_token_ids == tuple(IDS)
    seq = out.outputs[0]
    assert list(seq.token_ids) == want and seq.text == shown(tok, want)
    assert seq.finish_reason == ("stop" if want[-1] == EOS else "length") and seq.index == 0
    assert seq.logprobs is None and seq.cumulative_logprob is None
    text_out = engine.generate(TEXT, greedy())[0]
    ids = tok.encode(TEXT)
    assert text_out.prompt == TEXT and list(text_out.prompt_token_ids) == ids and ids[0] == 1
    assert list(text_out.outputs[0].token_ids) == engine.generate([ids], max_new_tokens=12)[0]


def test_every_prompt_form_gives_the_same_output_in_order(engine: Engine) -> None:
    """A string, a list of strings, token ids, a list of token-id lists and vLLM's prompt dicts are
    each one prompt; a call returns one output per prompt, in order, each with its own request id."""
    ids = Tokenizer.from_pretrained(engine.config.checkpoint).encode(TEXT)
    params = greedy(6)
    base = one(engine, TEXT, params)
    for form in (TEXT, [TEXT], ids, [ids], {"prompt": TEXT}, {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}]):
        assert one(engine, form, params).token_ids == base.token_ids, form
    outs = engine.generate([TEXT, IDS, {"prompt": "Hello"}], params)
    assert [o.outputs[0].token_ids for o in outs[:2]] == [base.token_ids, one(engine, IDS, params).token_ids]
    assert [o.prompt for o in outs] == [TEXT, None, "Hello"]
    assert len({o.request_id for o in outs}) == 3
    per_prompt = engine.generate([TEXT, TEXT], [greedy(3), greedy(5)])
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [3, 5]
    assert engine.generate([], params) == []


def test_a_stop_string_cuts_the_text_and_ends_the_sequence(engine: Engine, tok: Tokenizer) -> None:
    """A stop string from the middle of a greedy answer cuts the text before it (kept with
    include_stop_str_in_output), finish "stop" with the string as stop_reason; the tokens end at
    the one that completed it, and the engine request is aborted: every KV block is free."""
    whole = one(engine, "Caf\u00e9 na", greedy(32, ignore_eos=True))
    assert whole.text is not None
    stop = next(whole.text[i:i + 3] for i in range(2, len(whole.text) - 3) if "\ufffd" not in whole.text[i:i + 3])
    cut = one(engine, "Caf\u00e9 na", greedy(32, ignore_eos=True, stop=[stop, "never seen"]))
    at = whole.text.index(stop)
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (whole.text[:at], "stop", stop)
    n = len(cut.token_ids)
    assert cut.token_ids == whole.token_ids[:n] and n < len(whole.token_ids)
    assert stop in tok.decode(list(cut.token_ids))[at:]
    kept = one(engine, "Caf\u00e9 na", greedy(32, ignore_eos=True, stop=stop, include_stop_str_in_output=True))
    assert kept.text == whole.text[: at + len(stop)] and kept.token_ids == cut.token_ids
    assert engine.num_free_kv_blocks == engine.num_kv_blocks and engine.stats().running == 0


def test_stop_token_ids_add_to_the_end_of_sequence_ids(engine: Engine) -> None:
    """stop_token_ids end a sequence besides EOS (vLLM's rule): a forced stop id ends it with that
    id as stop_reason, a forced EOS still ends it (stop_reason None), ignore_eos runs past EOS; a
    stop token is in token_ids but not in the text."""
    by_id = one(engine, IDS, greedy(5, logit_bias={FORCED: 100}, stop_token_ids=[FORCED]))
    assert (by_id.token_ids, by_id.finish_reason, by_id.stop_reason, by_id.text) == ((FORCED,), "stop", FORCED, "")
    by_eos = one(engine, IDS, greedy(5, logit_bias={EOS: 100}, stop_token_ids=[FORCED]))
    assert (by_eos.token_ids, by_eos.finish_reason, by_eos.stop_reason, by_eos.text) == ((EOS,), "stop", None, "")
    past = one(engine, IDS, greedy(5, logit_bias={EOS: 100}, stop_token_ids=[FORCED], ignore_eos=True))
    assert (past.token_ids, past.finish_reason) == ((EOS,) * 5, "length")
    # the token-id form keeps its own rule: stop_token_ids replace EOS
    assert engine.generate([IDS], max_new_tokens=5, stop_token_ids=[]) == [list(
        one(engine, IDS, greedy(5, ignore_eos=True)).token_ids)]


def test_n_sequences_greedy_equal_and_sampled_seeded_per_index(engine: Engine) -> None:
    """n=3 greedy gives three equal sequences indexed 0..2; n=4 sampled with a seed is
    reproducible, differs between sequences, and sequence i is the n=1 request seeded seed + i."""
    (g,) = engine.generate(TEXT, greedy(6, n=3))
    assert [o.index for o in g.outputs] == [0, 1, 2] and len({o.token_ids for o in g.outputs}) == 1
    assert g.outputs[0].token_ids == one(engine, TEXT, greedy(6)).token_ids
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=4, ignore_eos=True)
    first, again = engine.generate(TEXT, sampled)[0], engine.generate(TEXT, sampled)[0]
    texts = [o.text for o in first.outputs]
    assert texts == [o.text for o in again.outputs] and len(set(texts)) > 1
    for i, o in enumerate(first.outputs):
        alone = one(engine, TEXT, SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i, ignore_eos=True))
        assert (o.index, o.token_ids) == (i, alone.token_ids)


def test_cumulative_logprob_is_the_sum_of_the_returned_logprobs(engine: Engine) -> None:
    """With logprobs asked, each token has its draw and cumulative_logprob is their sum; the
    sequence's greedy tokens are each top-1."""
    seq = one(engine, TEXT, greedy(8, logprobs=2))
    assert seq.logprobs is not None and [t.token_id for t in seq.logprobs] == list(seq.token_ids)
    assert seq.cumulative_logprob == pytest.approx(sum(t.logprob or 0.0 for t in seq.logprobs), abs=1e-9)
    assert seq.cumulative_logprob is not None and seq.cumulative_logprob < 0
    assert all(t.top[0][0] == t.token_id and len(t.top) == 2 for t in seq.logprobs)


def test_chat_renders_the_template_and_generates(engine: Engine, tok: Tokenizer) -> None:
    """chat renders each conversation with the checkpoint's template (no special tokens added),
    generates as generate does on the rendered ids; text parts are joined; a list of
    conversations gives one output each."""
    rendered = "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n"
    (out,) = engine.chat(CHAT, greedy(8))
    assert out.prompt == rendered and list(out.prompt_token_ids) == tok.encode(rendered, add_special_tokens=False)
    assert out.outputs[0].token_ids == one(engine, list(out.prompt_token_ids), greedy(8)).token_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world!"}]}]
    two = engine.chat([parts, [{"role": "user", "content": "Hi"}]], greedy(8))
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert two[1].prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    (open_turn,) = engine.chat(CHAT, greedy(2), add_generation_prompt=False)
    assert open_turn.prompt == rendered.removesuffix("<|im_start|>assistant\n")


class StepGate:
    """Holds an engine's forwards until its consumer has received enough outputs: forward f
    (counted from 1) waits until ``received >= min(cap, f - slack)``, so the engine runs at most
    ``slack`` steps ahead of what the consumer has seen, however fast the machine decodes (the
    wait is bounded, against hanging)."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch, *, slack: int, cap: int | None = None):
        self.received = self.forwards = 0
        self.expired = False  # a wait ran out: the outputs never came, the test's assertions will say so
        self.cond = threading.Condition()
        run = engine._group.run

        def gated_run(method: str, *args: Any, **kwargs: Any) -> Any:
            if method in ("forward", "forward_greedy"):
                with self.cond:
                    self.forwards += 1
                    need = self.forwards - slack if cap is None else min(cap, self.forwards - slack)
                    if not self.expired:
                        self.expired = not self.cond.wait_for(lambda: self.received >= need, timeout=60)
            return run(method, *args, **kwargs)

        monkeypatch.setattr(engine._group, "run", gated_run)

    def got_one(self) -> None:
        with self.cond:
            self.received += 1
            self.cond.notify_all()


def test_async_generate_yields_cumulative_outputs_ending_finished(
    checkpoint: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AsyncEngine.generate yields outputs whose tokens and text grow, finished only on the last,
    which equals Engine.generate's output (stop strings and n included); abort(request_id) ends
    every sequence of a request with "abort". Where the test needs several outputs, a StepGate
    keeps the engine from finishing before the consumer has read them."""
    plain = engine.generate(TEXT, greedy(10, ignore_eos=True))[0].outputs[0]
    assert plain.text is not None
    stop = plain.text[4:7]
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=2, ignore_eos=True)
    want_sampled = engine.generate(TEXT, sampled)[0]
    want_stopped = engine.generate(TEXT, greedy(10, ignore_eos=True, stop=stop))[0].outputs[0]

    async def main() -> None:
        async with AsyncEngine.from_pretrained(checkpoint) as a:
            gate = StepGate(a.engine, monkeypatch, slack=1)  # one step ahead: one output per token
            seen = []
            async for out in a.generate(TEXT, greedy(10, ignore_eos=True), request_id="r1"):
                seen.append(out)
                gate.got_one()
            monkeypatch.undo()
            assert gate.forwards >= 10 and not gate.expired  # the gate held every step of r1
            assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True] and len(seen) > 1
            assert all(o.request_id == "r1" for o in seen)
            for before, after in itertools.pairwise(seen):
                b, c = before.outputs[0], after.outputs[0]
                assert c.token_ids[: len(b.token_ids)] == b.token_ids and (c.text or "").startswith(b.text or "")
            assert seen[-1].outputs[0] == plain
            last = [out async for out in a.generate(TEXT, sampled)][-1]
            assert last.outputs == want_sampled.outputs
            cut = [out async for out in a.generate(TEXT, greedy(10, ignore_eos=True, stop=stop))][-1]
            assert cut.outputs[0] == want_stopped
            long = SamplingParams(max_tokens=200, temperature=1.0, seed=1, n=2, ignore_eos=True)
            gate = StepGate(a.engine, monkeypatch, slack=5, cap=2)  # 200 tokens cannot end before the abort
            outs = []
            async for out in a.generate(IDS, long, request_id="cut-me"):
                outs.append(out)
                gate.got_one()
                if len(outs) == 2:
                    assert await a.abort("cut-me")
            monkeypatch.undo()
            assert outs[-1].finished and [o.finish_reason for o in outs[-1].outputs] == ["abort", "abort"]
            assert a.stats().running == 0

    asyncio.run(asyncio.wait_for(main(), TIMEOUT))


@pytest.mark.parametrize(("call", "field"), [
    (lambda e: e.generate(123, greedy()), "prompts"),
    (lambda e: e.generate([{"text": "x"}], greedy()), "prompts"),
    (lambda e: e.generate([TEXT, TEXT], [greedy()]), "sampling_params"),
    (lambda e: e.generate(TEXT, "greedy"), "sampling_params"),
    (lambda e: e.generate(TEXT, max_new_tokens=3), "max_new_tokens"),
    (lambda e: e.generate(IDS, greedy(), 0.5), "temperature"),
    (lambda e: e.generate([[]], greedy()), "prompt"),
    (lambda e: e.generate(TEXT, SamplingParams(n=257)), "n"),
    (lambda e: e.generate(TEXT, SamplingParams(skip_special_tokens="no")), "skip_special_tokens"),
    (lambda e: e.chat([], greedy()), "messages"),
    (lambda e: e.chat([{"role": "user", "content": [{"type": "image_url"}]}], greedy()), "messages"),
    (lambda e: e.chat(CHAT, greedy(), chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (lambda e: e.chat(CHAT, greedy(), tools="all"), "tools"),
])
def test_bad_inputs_are_invalid_request_errors_naming_the_argument(engine: Engine, call: Any, field: str) -> None:
    """Each bad prompt, setting or conversation raises InvalidRequestError whose field names it; nothing runs."""
    with pytest.raises(InvalidRequestError) as excinfo:
        call(engine)
    assert excinfo.value.field == field
    assert engine.num_free_kv_blocks == engine.num_kv_blocks


def test_async_bad_inputs_name_the_argument(checkpoint: Path) -> None:
    """AsyncEngine.generate takes one prompt and stream one sequence; both say so by field."""

    async def main() -> None:
        async with AsyncEngine.from_pretrained(checkpoint) as a:
            with pytest.raises(InvalidRequestError) as excinfo:
                [out async for out in a.generate([TEXT, TEXT], greedy())]
            assert excinfo.value.field == "prompt"
            with pytest.raises(InvalidRequestError) as excinfo:
                a.stream(IDS, greedy(n=2))
            assert excinfo.value.field == "n"

    asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def test_a_checkpoint_without_a_tokenizer_takes_token_ids_only(tmp_path: Path) -> None:
    """Without tokenizer.json the outputs form runs token ids (text None); text prompts, stop
    strings and chat are refused by name."""
    make_checkpoint(tmp_path)
    with Engine.from_pretrained(tmp_path) as e:
        seq = one(e, IDS, greedy(4, ignore_eos=True))
        assert seq.text is None and len(seq.token_ids) == 4 and e.get_tokenizer() is None
        for call, field in ((lambda: e.generate("hi", greedy()), "prompts"),
                            (lambda: e.generate(IDS, greedy(stop="x")), "stop"),
                            (lambda: e.chat(CHAT, greedy()), "messages")):
            with pytest.raises(InvalidRequestError) as excinfo:
                call()
            assert excinfo.value.field == field


# -- against rtpcore serve ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    srv = Server(checkpoint, "--max-batch-size", "8")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return dict(r.json())


def assert_same(choice: dict[str, Any], usage_tokens: int, seq: CompletionOutput, chat: bool = False) -> None:
    text = choice["message"]["content"] if chat else choice["text"]
    assert (text, choice["finish_reason"]) == (seq.text, seq.finish_reason)
    assert usage_tokens == len(seq.token_ids)


@pytest.mark.slow
def test_completions_equal_the_servers(server: Server, engine: Engine) -> None:
    """Greedy completions of text and of token ids, a stop string and a stop id: the offline
    outputs have the server's text, finish_reason and completion token count."""
    cases: list[tuple[Any, dict[str, Any], SamplingParams]] = [
        (TEXT, {}, greedy(16)),
        (IDS, {}, greedy(16)),
        (IDS, {"logit_bias": {str(FORCED): 100}, "stop_token_ids": [FORCED]},
         greedy(16, logit_bias={FORCED: 100}, stop_token_ids=[FORCED])),
    ]
    whole = post(server, "/v1/completions", {"prompt": "Caf\u00e9 na", "max_tokens": 32, "temperature": 0})
    stop = whole["choices"][0]["text"][3:6]
    cases.append(("Caf\u00e9 na", {"stop": [stop]}, greedy(32, stop=[stop])))
    cases.append(("Caf\u00e9 na", {"stop": [stop], "include_stop_str_in_output": True},
                  greedy(32, stop=[stop], include_stop_str_in_output=True)))
    for prompt, extra, params in cases:
        body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0, **extra}
        got = post(server, "/v1/completions", body)
        assert_same(got["choices"][0], got["usage"]["completion_tokens"], one(engine, prompt, params))
    logprobs = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 8, "temperature": 0, "logprobs": 2})
    seq = one(engine, TEXT, greedy(8, logprobs=2))
    assert sum(logprobs["choices"][0]["logprobs"]["token_logprobs"]) == pytest.approx(seq.cumulative_logprob, abs=1e-4)


@pytest.mark.slow
def test_n_choices_equal_the_servers(server: Server, engine: Engine) -> None:
    """n sampled choices with a seed, and n greedy ones, are the server's choices in order."""
    for temperature, seed in ((1.0, 11), (0.0, None)):
        body = {"prompt": TEXT, "max_tokens": 10, "temperature": temperature, "n": 3, "ignore_eos": True}
        if seed is not None:
            body["seed"] = seed
        got = post(server, "/v1/completions", body)
        params = SamplingParams(max_tokens=10, temperature=temperature, seed=seed, n=3, ignore_eos=True)
        (out,) = engine.generate(TEXT, params)
        assert [c["text"] for c in got["choices"]] == [o.text for o in out.outputs]
        assert got["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in out.outputs)


@pytest.mark.slow
def test_chat_equals_the_servers(server: Server, engine: Engine) -> None:
    """A chat's answer is the server's /v1/chat/completions answer: content, finish_reason,
    prompt and completion token counts."""
    for params, extra in ((greedy(12), {}), (SamplingParams(max_tokens=12, temperature=0.9, seed=2), {"seed": 2})):
        body = {"messages": CHAT, "max_tokens": 12, "temperature": params.temperature, **extra}
        got = post(server, "/v1/chat/completions", body)
        (out,) = engine.chat(CHAT, params)
        assert_same(got["choices"][0], got["usage"]["completion_tokens"], out.outputs[0], chat=True)
        assert got["usage"]["prompt_tokens"] == len(out.prompt_token_ids)

