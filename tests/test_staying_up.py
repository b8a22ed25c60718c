"""No request ends the engine (docs/design.md §22), at the engine's level: a grammar that refuses
the first token ends its request with no token, an ordinary finish; a grammar the grammar engine
gives up on, and a fault planted in one request's bookkeeping, fail that request alone; a fault in
the engine loop outside any request breaks the AsyncEngine at once -- every stream ends with it,
``failure`` says so -- instead of leaving a loop that is gone behind a healthy face.

Real engines on a tiny checkpoint, real llguidance grammars (compiled without the compiler's
probe, which refuses these schemas before they run: the engine must hold even when one gets
through), real threads; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from rtpcore import AsyncEngine, Engine, SamplingParams
from rtpcore.engine.sample.grammar import _JSON_OPTIONS, Grammar, GrammarCompiler
from rtpcore.engine.text.tokenizer import Tokenizer
from rtpcore.errors import InvalidRequestError, RequestFailedError, RtpcoreError
from test_llama import make_checkpoint
from test_serve import write_tokenizer

TIMEOUT = 300.0  # a bound against hanging, never a speed requirement
EOS = 2  # "</s>" in test_serve's tokenizer
PROMPTS = [[1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63]]
SELF_REFERENCE = {"$ref": "#"}
REQUIRED_RECURSION = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                      "required": ["x"]}}, "$ref": "#/$defs/a"}
MANY_PROPERTIES = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("staying_up")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=256)
    return path


@pytest.fixture(scope="module")
def compiler(checkpoint: Path) -> GrammarCompiler:
    tok = Tokenizer.from_pretrained(checkpoint)
    return GrammarCompiler(tok, vocab_size=tok.vocab_size, stop_token_ids=[EOS])


@pytest.fixture(scope="module")
def alone(checkpoint: Path) -> list[list[int]]:
    with Engine.from_pretrained(checkpoint) as e:
        return e.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[])


def unprobed(compiler: GrammarCompiler, schema: dict[str, Any]) -> Grammar:
    """``schema``'s grammar as llguidance compiles it, without the compiler's probe."""
    import llguidance

    text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    assert not llguidance.LLMatcher.validate_grammar(text, compiler.tokenizer)  # llguidance takes it
    return Grammar(compiler, text, f"JSON schema {json.dumps(schema)[:40]}", "response_format")


def run_streams(engine: AsyncEngine, params: list[SamplingParams]) -> list[tuple[list[int], Any]]:
    """Each prompt of PROMPTS with its params, all at once: (tokens, the last output or the error)."""

    async def one(prompt: list[int], sp: SamplingParams) -> tuple[list[int], Any]:
        tokens: list[int] = []
        last: Any = None
        try:
            async for out in engine.stream(prompt, sp):
                tokens += out.token_ids
                last = out
        except RtpcoreError as exc:
            return tokens, exc
        return tokens, last

    async def main() -> list[tuple[list[int], Any]]:
        return list(await asyncio.gather(*(one(p, sp) for p, sp in zip(PROMPTS, params, strict=True))))

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def plain() -> SamplingParams:
    return SamplingParams(max_tokens=12, ignore_eos=True)


def test_the_compiler_refuses_the_schemas_that_ended_the_engine_naming_the_field(compiler: GrammarCompiler) -> None:
    """A schema nothing satisfies, one whose required property recurses into itself and one of 5,000
    properties are InvalidRequestErrors naming the field (the server's 400s), each said once and
    cached: asking again refuses again without compiling."""
    cases = [(SELF_REFERENCE, "nothing can satisfy it"), (REQUIRED_RECURSION, "too large or too deeply recursive"),
             (MANY_PROPERTIES, "too large or too deeply recursive")]
    for schema, needle in cases:
        for field in ("response_format", "tools"):
            with pytest.raises(InvalidRequestError) as excinfo:
                compiler.json_schema(schema, field=field)
            assert excinfo.value.field == field
            assert str(excinfo.value).startswith(f"{field}: ") and needle in str(excinfo.value)
    # Usable schemas, recursive ones with a way out included, still compile.
    compiler.json_schema({"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {
        "$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"})
    compiler.json_schema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)},
                          "required": [f"p{i}" for i in range(50)]})


def test_a_grammar_that_refuses_the_first_token_ends_its_request_with_no_token(
    checkpoint: Path, compiler: GrammarCompiler, alone: list[list[int]]
) -> None:
    """A grammar that refuses the first sampled token (planted: it allows every token, then takes
    none) ends its request at once, finish_reason "stop" with no token -- once an IndexError in the
    step's commit that ended the engine. So does {"$ref": "#"}, which allows no text (at most the
    stop id). The requests beside them get their tokens alone, and the engine serves the next ones."""
    engine = AsyncEngine.from_pretrained(checkpoint)
    try:
        for grammar, allowed in ((_Refusing(), [[]]), (unprobed(compiler, SELF_REFERENCE), [[], [EOS]])):
            results = run_streams(engine, [plain(), SamplingParams(max_tokens=16, grammar=grammar), plain()])
            (first, _), (refused, last), (third, _) = results
            assert refused in allowed and last.finish_reason == "stop" and last.error is None
            assert last.num_generated_tokens == len(refused)
            assert [first, third] == [alone[0], alone[2]]
        again = run_streams(engine, [plain(), plain(), plain()])
        assert [tokens for tokens, _ in again] == alone
        stats = engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.request_errors_total == 0
        assert engine.failure is None
    finally:
        asyncio.run(engine.aclose())


@pytest.mark.parametrize("schema", [REQUIRED_RECURSION, MANY_PROPERTIES], ids=["recursion", "5000-properties"])
def test_a_grammar_the_grammar_engine_gives_up_on_fails_its_request_alone(
    checkpoint: Path, compiler: GrammarCompiler, alone: list[list[int]], schema: dict[str, Any]
) -> None:
    """llguidance stops parsing these after their first token: the request fails with a
    RequestFailedError (reason "grammar", naming llguidance's error), counted as a request error;
    the others are untouched and every block comes back."""
    grammar = unprobed(compiler, schema)
    engine = AsyncEngine.from_pretrained(checkpoint)
    try:
        (first, _), (_, error), (third, _) = run_streams(
            engine, [plain(), SamplingParams(max_tokens=200, grammar=grammar), plain()])
        assert isinstance(error, RequestFailedError) and error.reason == "grammar"
        assert "can go no further" in str(error) and error.request_id
        assert [first, third] == [alone[0], alone[2]]
        stats = engine.stats()
        assert stats.request_errors_total == 1 and stats.kv_blocks_free == stats.kv_blocks_total
        assert engine.failure is None
    finally:
        asyncio.run(engine.aclose())


class _Faulty:
    """A grammar whose state allows every token and raises in the commit of its ``n``-th one: a
    bug planted in one request's bookkeeping."""

    stop_token_ids = (EOS,)

    def __init__(self, n: int):
        self.n = n

    def state(self) -> Any:
        return _FaultyState(self.n)


class _FaultyState:
    def __init__(self, n: int):
        self.n = n
        self.error = None
        self.done = False
        self.accepting = True

    def accept(self, token_id: int) -> bool:
        self.n -= 1
        if self.n == 0:
            raise KeyError("planted fault in the request's bookkeeping")
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1  # every bit: every token allowed


class _Refusing(_Faulty):
    """A grammar whose state allows every token and accepts none, without an error."""

    def __init__(self) -> None:
        super().__init__(0)

    def state(self) -> Any:
        state = _FaultyState(0)
        state.accepting = False
        state.accept = lambda token_id: False  # type: ignore[method-assign]
        return state


def test_a_fault_in_one_requests_bookkeeping_fails_it_alone(checkpoint: Path, alone: list[list[int]]) -> None:
    """An exception raised while one request's step is committed ends that request with a
    RequestFailedError (reason "internal", the exception as its cause), logged and counted; the
    requests of the same steps get the tokens they get alone; the engine keeps serving."""
    engine = AsyncEngine.from_pretrained(checkpoint)
    try:
        (first, _), (got, error), (third, _) = run_streams(
            engine, [plain(), SamplingParams(max_tokens=12, ignore_eos=True, grammar=_Faulty(3)), plain()])
        assert isinstance(error, RequestFailedError) and error.reason == "internal"
        assert isinstance(error.__cause__, KeyError) and "planted fault" in str(error)
        # at most the two tokens committed before the fault came out (a stream that lags merges them
        # into the failing output, which raises), the same as the request's own tokens alone
        assert len(got) <= 2 and got == alone[1][: len(got)]
        assert [first, third] == [alone[0], alone[2]]
        assert [tokens for tokens, _ in run_streams(engine, [plain(), plain(), plain()])] == alone
        stats = engine.stats()
        assert stats.request_errors_total == 1 and stats.kv_blocks_free == stats.kv_blocks_total
    finally:
        asyncio.run(engine.aclose())


def test_a_fault_in_the_engine_loop_outside_any_request_breaks_the_engine_at_once(checkpoint: Path) -> None:
    """A fault planted in the scheduler (the loop's own work, no request's) breaks the AsyncEngine:
    every stream in flight ends with the error at once, ``broken`` and ``failure`` name it, each
    on_broken callback runs once, and a later request is refused."""
    engine = AsyncEngine.from_pretrained(checkpoint)
    told: list[RtpcoreError] = []
    engine.on_broken.append(told.append)
    scheduler = engine.engine.core.scheduler  # the fault is planted on this instance only
    real = scheduler.schedule
    armed = asyncio.Event()

    def schedule() -> Any:
        if armed.is_set():
            raise RuntimeError("planted fault in the scheduler")
        return real()

    scheduler.schedule = schedule

    async def main() -> list[Any]:
        async def one(prompt: list[int]) -> Any:
            try:
                async for out in engine.stream(prompt, SamplingParams(max_tokens=200, ignore_eos=True)):
                    if out.token_ids:
                        armed.set()  # every stream is running: the next plan raises
            except RtpcoreError as exc:
                return exc
            return "finished"

        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))

    try:
        ended = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
        assert all(isinstance(e, RtpcoreError) and "planted fault in the scheduler" in str(e) for e in ended), ended
        assert engine.broken is not None and "planted fault" in str(engine.broken)
        assert engine.failure is engine.broken
        deadline = time.monotonic() + TIMEOUT  # the callbacks run on the loop thread once the streams have ended
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)
        assert told == [engine.broken]

        async def later() -> None:
            engine.stream(PROMPTS[0], plain())

        with pytest.raises(RtpcoreError, match="closed"):
            asyncio.run(later())
    finally:
        asyncio.run(engine.aclose())
