"""Structured output over every kind of tokenizer a checkpoint ships (docs/design.md §17, "Any
tokenizer"): byte-level BPE, Metaspace BPE, a SentencePiece BPE as transformers converts it (a Fuse
decoder with byte fallback), the same with a custom decoder (Fuse without byte fallback) and
WordPiece. The grammar's token table is the bytes the tokenizer's own decoder writes for each id
(``Tokenizer.token_table``), never a reading guessed from the decoder's type; JSON schema, JSON
object, regex and choice outputs decoded by the tokenizer parse and validate, through the Engine
for each kind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

from rtpcore import Engine, SamplingParams  # noqa: E402
from rtpcore.engine.sample.grammar import GrammarCompiler, _allowed  # noqa: E402
from rtpcore.engine.text.tokenizer import Tokenizer  # noqa: E402
from test_llama import make_checkpoint  # noqa: E402
from tokenizer_files import KIND_CORPUS, KINDS, kind_tokenizer, write_kind  # noqa: E402

EOS = 2  # "</s>" in every kind
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "active", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"grammar-{kind}")
    vocab = write_kind(path, kind)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=1024)
    return path


def test_the_token_table_spells_what_the_decoder_writes_after_text(kind: str) -> None:
    """For every sentence of the corpus (words, JSON, accents, CJK, emoji, a euro sign that byte-fallback
    tokenizers spell in three pieces), the table's bytes of its ids, after the anchor token's text, are
    the tokenizer's decode of anchor + ids: what each id writes, sub-character pieces included."""
    backend = kind_tokenizer(kind)
    tok = Tokenizer(backend)
    table = tok.token_table()
    assert len(table) == tok.vocab_size and table[EOS] == b"</s>"
    anchor, head = tok._anchor
    fresh = Tokenizer(kind_tokenizer(kind))
    checked = 0
    for text in [*KIND_CORPUS[:5], '{"k": "v"} caf\u00e9 \u2713 \u20ac']:
        ids = backend.encode(text, add_special_tokens=False).ids
        if set(ids) & tok.added_token_ids:  # "<unk>" (no euro sign in the vocabulary): a grammar never writes it
            continue
        want = backend.decode([anchor, *ids], skip_special_tokens=False).encode()
        assert head.encode() + b"".join(table[i] for i in ids) == want, text
        assert all(fresh.token_bytes(i) == table[i] for i in ids)  # one id at a time, without the table
        checked += 1
    assert checked >= 5


def test_sub_character_pieces_get_their_bytes_and_word_pieces_their_spaces() -> None:
    """A byte-level piece and a byte-fallback piece of U+20AC are its bytes; a Metaspace word writes its
    space; a WordPiece word writes a leading space, a ## piece none; without ByteFallback in the decoder
    a <0xNN> piece writes its six characters, as that tokenizer decodes it."""
    level = Tokenizer(kind_tokenizer("byte_level"))
    assert b"".join(level.token_table()[i] for i in level.encode("\u20ac", add_special_tokens=False)) == b"\xe2\x82\xac"
    sp = Tokenizer(kind_tokenizer("sentencepiece"))
    assert sp.token_table()[sp.token_to_id("<0xE2>")] == b"\xe2"
    fuse = Tokenizer(kind_tokenizer("fuse"))
    assert fuse.token_table()[fuse.token_to_id("<0xE2>")] == b"<0xE2>"
    meta = Tokenizer(kind_tokenizer("metaspace"))
    assert meta.token_table()[meta.token_to_id("\u2581Paris.")] == b" Paris."
    wp = Tokenizer(kind_tokenizer("wordpiece"))
    assert wp.token_table()[wp.token_to_id("a")] == b" a" and wp.token_table()[wp.token_to_id("##e")] == b"e"
    assert [Tokenizer(kind_tokenizer(k)).text_start for k in KINDS] == ["", "", "", "", " "]


def test_llguidance_reading_tokenizer_json_itself_refuses_these_decoders(tmp_path: Path) -> None:
    """Why the table comes from rtpcore's tokenizer: llguidance's own reading of tokenizer.json guesses
    the byte reading from the decoder's type and refuses Metaspace, WordPiece and a Fuse sequence
    without byte fallback."""
    for kind in ("metaspace", "fuse", "wordpiece"):
        path = tmp_path / f"{kind}.json"
        kind_tokenizer(kind).save(str(path))
        with pytest.raises(ValueError, match="can't determine decoder type"):
            llguidance.LLTokenizer(str(path), n_vocab=kind_tokenizer(kind).get_vocab_size(), eos_token=[EOS])


def test_a_wordpiece_grammar_starts_with_a_whole_word_never_a_continuation(checkpoint: Path, kind: str) -> None:
    """A text's first token: WordPiece writes a word without its leading space there and a ## piece
    with its "##", so every id a JSON grammar allows first decodes, alone, to text starting with "{";
    for every kind."""
    tok = Tokenizer.from_pretrained(checkpoint)
    compiler = GrammarCompiler(tok, vocab_size=tok.vocab_size, stop_token_ids=[EOS])
    state = compiler.json_schema(PERSON).state()
    mask = torch.zeros((1, (tok.vocab_size + 31) // 32), dtype=torch.int32)
    state.fill(mask, 0)
    first = _allowed(mask[0], tok.vocab_size)
    assert first and all(tok.decode([t]).startswith("{") for t in first)
    if kind == "wordpiece":
        assert not any(tok.id_to_token(t).startswith("##") for t in first)


def decoded(out: Any) -> str:
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    return str(out.text)


def test_json_schema_object_regex_and_choice_outputs_validate_through_the_engine(checkpoint: Path, kind: str) -> None:
    """Greedy and two seeded sampled requests per grammar on the tiny random model (which never writes
    JSON by itself): each text, as the tokenizer decodes it, parses and validates against the schema,
    is a JSON object, matches the regex whole, or is one of the choices; the requests end at the
    grammar's end ("stop"). The trained vocabularies' ids may differ from run to run (the trainers break
    ties in no fixed order), so nothing here depends on which text comes out."""
    import re

    tok = Tokenizer.from_pretrained(checkpoint)
    compiler = GrammarCompiler(tok, vocab_size=tok.vocab_size, stop_token_ids=[EOS])
    grammars = {"schema": compiler.json_schema(PERSON), "object": compiler.json_object(),
                "regex": compiler.regex(r"[a-z]{2,8}: [0-9]{1,3}"), "choice": compiler.choice(["red", "green", "blue"])}
    prompt = {"prompt_token_ids": [1, 40, 41, 42]}
    # Any JSON object is a random walk for a random model, which may nest for thousands of tokens: a bias
    # towards the ids that close a string or an object makes it end soon (masked ids stay masked,
    # whatever their bias).
    bias = {b'"': 15.0, b' "': 12.0, b"}": 10.0}  # a string closes before an object does
    closing = {i: bias[raw] for i, raw in enumerate(tok.token_table()) if raw in bias}
    with Engine.from_pretrained(checkpoint) as engine:
        for name, grammar in grammars.items():
            for seed in (None, 1, 2):
                params = SamplingParams(max_tokens=600, grammar=grammar, temperature=0.0 if seed is None else 1.0,
                                        seed=seed, logit_bias=closing if name == "object" else None)
                text = decoded(engine.generate([prompt], params)[0].outputs[0])
                if name == "schema":
                    jsonschema.validate(json.loads(text), PERSON)
                    assert ", " in text and ": " in text and "  " not in text
                elif name == "object":
                    assert isinstance(json.loads(text), dict)
                elif name == "regex":
                    assert re.fullmatch(r"[a-z]{2,8}: [0-9]{1,3}", text), text
                else:
                    assert text in ("red", "green", "blue")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATIENCE_S = 300.0  # a bound against hanging, never a speed requirement


@pytest.mark.slow
@pytest.mark.parametrize("served_kind", ["wordpiece", "fuse"])
def test_response_format_over_http_with_a_wordpiece_and_a_custom_decoder(
    served_kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """rtpcore serve over a WordPiece and a Fuse-without-byte-fallback checkpoint (both of which
    llguidance's own tokenizer.json reading refuses): chat json_schema answers, greedy and seeded,
    parse and validate, streamed deltas join to the same text; a completions json_object answer
    parses to an object."""
    httpx = pytest.importorskip("httpx")
    from test_serve import Server

    path = tmp_path_factory.mktemp(f"served-{served_kind}")
    vocab = write_kind(path, served_kind, chat_template=CHATML)
    make_checkpoint(path, vocab_size=vocab, max_position_embeddings=1024)
    tok = Tokenizer.from_pretrained(path)
    server = Server(path)
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        ask = [{"role": "user", "content": "Who is Ada?"}]
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            body = {"model": "tiny", "messages": ask, "max_tokens": 600, "response_format": fmt, **sampling}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=PATIENCE_S)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            text = choice["message"]["content"]
            jsonschema.validate(json.loads(text), PERSON)
            pieces = []
            with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=PATIENCE_S,
                              json={**body, "stream": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        pieces += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
            assert "".join(pieces) == text
        bias = {str(i): 15.0 for i, raw in enumerate(tok.token_table()) if raw in (b'"', b' "')}
        bias.update({str(i): 10.0 for i, raw in enumerate(tok.token_table()) if raw == b"}"})
        r = httpx.post(server.url + "/v1/completions", timeout=PATIENCE_S, json={
            "model": "tiny", "prompt": "Data:", "max_tokens": 600, "temperature": 1.0, "seed": 4,
            "response_format": {"type": "json_object"}, "logit_bias": bias})
        assert r.status_code == 200, r.text
        assert isinstance(json.loads(r.json()["choices"][0]["text"]), dict)
    finally:
        code, out = server.stop()
    assert code == 0, out
