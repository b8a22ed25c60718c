"""rtpcore.engine.sample.grammar (docs/design.md §16) with the engine: masks touch only constrained rows (and
cost nothing without one), constrained requests write valid JSON under the schema beside unconstrained
ones that keep their tokens, a speculative draft keeps proposing for the others, and bad schemas are
InvalidRequestErrors naming the field."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

from rtpcore import AsyncEngine, Engine  # noqa: E402
from rtpcore.engine.sample.grammar import GrammarCompiler, apply_grammar_masks  # noqa: E402
from rtpcore.engine.sample.params import SamplingParams  # noqa: E402
from rtpcore.engine.text.tokenizer import Tokenizer  # noqa: E402
from rtpcore.errors import InvalidRequestError  # noqa: E402
from test_llama import make_checkpoint  # noqa: E402
from test_serve import write_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["x", "y"]},
    "note": {"type": "string", "maxLength": 8},
}, "required": ["id", "kind", "note"], "additionalProperties": False}
EOS = 2  # "</s>" in test_serve's tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grammar")
    vocab = write_tokenizer(path)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=512)
    return path


@pytest.fixture(scope="module")
def compiler(checkpoint: Path) -> GrammarCompiler:
    tok = Tokenizer.from_pretrained(checkpoint)
    return GrammarCompiler(tok, vocab_size=tok.vocab_size, stop_token_ids=[EOS])


def test_masks_touch_only_the_constrained_rows(compiler: GrammarCompiler, checkpoint: Path) -> None:
    tok = Tokenizer.from_pretrained(checkpoint)
    v = compiler.vocab_size
    x = torch.randn(3, v)
    assert apply_grammar_masks(x, [None, None, None]) is x  # nothing to do: the same tensor
    state = compiler.json_schema(SCHEMA).state()
    masked = apply_grammar_masks(x, [None, state, None])
    assert torch.equal(masked[0], x[0]) and torch.equal(masked[2], x[2])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed and all(tok.token_bytes(t).startswith(b"{") for t in allowed)
    assert EOS not in allowed and torch.isfinite(x).all()  # x itself untouched


def test_bad_schemas_name_the_field(compiler: GrammarCompiler) -> None:
    with pytest.raises(InvalidRequestError, match="response_format: invalid or unsupported JSON schema") as excinfo:
        compiler.json_schema({"type": "objectx"})
    assert excinfo.value.field == "response_format"
    with pytest.raises(InvalidRequestError, match="tools: a JSON schema must be an object"):
        compiler.json_schema(["not", "a", "schema"], field="tools")
    assert compiler.json_schema(SCHEMA) is compiler.json_schema(dict(SCHEMA))  # cached by content


def run(engine: AsyncEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    async def one(p: list[int], sp: SamplingParams) -> list[int]:
        out: list[int] = []
        async for o in engine.stream(p, sp):
            out += o.token_ids
        return out

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params, strict=True))))

    return asyncio.run(main())


PROMPTS = [[1, 40, 41, 42], [1, 50, 51], [1, 60], [1, 70, 71, 72, 73]]


def check_json(tok: Tokenizer, ids: list[int]) -> Any:
    if ids[-1] == EOS:  # the grammar may end on the stop id, or right after its last token
        ids = ids[:-1]
    value = json.loads(tok.decode(ids))
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("draft", [False, True])
def test_constrained_and_plain_requests_in_one_batch(checkpoint: Path, compiler: GrammarCompiler, draft: bool) -> None:
    """Two constrained requests (greedy and seeded) batched with two plain ones: the constrained write
    valid JSON and end there; the plain get the tokens they get alone without a draft."""
    tok = Tokenizer.from_pretrained(checkpoint)
    grammar = compiler.json_schema(SCHEMA)
    with Engine.from_pretrained(checkpoint) as e:
        alone = e.generate([PROMPTS[1], PROMPTS[3]], max_new_tokens=20, stop_token_ids=[])
    spec: dict[str, Any] = {"draft_model": str(checkpoint), "num_speculative_tokens": 3} if draft else {}
    engine = AsyncEngine.from_pretrained(checkpoint, **spec)
    try:
        params = [SamplingParams(max_tokens=200, grammar=grammar),
                  SamplingParams(max_tokens=20, ignore_eos=True),
                  SamplingParams(max_tokens=200, temperature=1.0, seed=5, grammar=grammar),
                  SamplingParams(max_tokens=20, ignore_eos=True)]
        out = run(engine, PROMPTS, params)
        check_json(tok, out[0])
        check_json(tok, out[2])
        assert [out[1], out[3]] == alone
        if draft:  # the plain requests speculated; the constrained ones decoded without proposals
            stats = engine.engine.speculative_stats
            assert 0 < stats.proposed <= 3 * 2 * 19
    finally:
        asyncio.run(engine.aclose())


def test_a_schema_asked_for_by_many_threads_at_once_is_compiled_once(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/design.md §17: the calls for a schema another thread is compiling wait for that
    compile (the same 50,000-value enum sent by several clients at once is compiled once). The
    first compile is held inside its probe until the other callers have had a second to start
    their own; then all of them get the one grammar."""
    import threading

    schema = {"type": "object", "properties": {"once": {"enum": [f"v{i}" for i in range(200)]}}}
    probes: list[int] = []
    release = threading.Event()
    real = GrammarCompiler.probe

    def probe(self: GrammarCompiler, grammar: Any) -> str | None:
        probes.append(1)
        release.wait(timeout=60)
        return real(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "probe", probe)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(compiler.json_schema(schema))) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 1.0  # time for a wrong implementation to start a second compile
    while time.monotonic() < deadline and len(probes) < 2:
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(timeout=120)
    assert len(probes) == 1 and len(results) == 4 and all(r is results[0] for r in results)


def test_each_state_of_a_grammar_is_a_copy_of_one_matcher(compiler: GrammarCompiler) -> None:
    """The n choices of a request each get a GrammarState copied from the matcher built once per
    grammar (llguidance's deep_copy), never a rebuilt one; the copies advance apart."""
    grammar = compiler.json_schema({"type": "object", "properties": {"copied": {"type": "integer"}}})
    first = grammar.state()
    prototype = grammar._prototype
    states = [grammar.state() for _ in range(16)]
    assert grammar._prototype is prototype is not None
    assert len({id(s._matcher) for s in [first, *states]}) == 17

    def mask(state: Any) -> torch.Tensor:
        m = torch.zeros((1, (compiler.vocab_size + 31) // 32), dtype=torch.int32)
        state.fill(m, 0)
        return m

    start = mask(first)
    allowed = ((start[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1).nonzero().flatten()
    assert states[0].accept(int(allowed[0]))
    assert not torch.equal(mask(states[0]), start) and torch.equal(mask(states[1]), start)
