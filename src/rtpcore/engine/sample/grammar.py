"""Grammar-constrained decoding (docs/design.md §16), on llguidance.

A :class:`GrammarCompiler` knows one model's vocabulary -- the bytes of every token id, from
rtpcore's tokenizer itself (``Tokenizer.token_table``: what each id writes after other text,
whatever its decoder; added and special tokens spell no text, so no grammar writes with them)
and the ids that end a request -- and compiles JSON schemas (OpenAI's ``response_format``,
tool-call arguments) into :class:`Grammar` objects, cached by schema. The JSON grammars allow
no free whitespace: the separators are exactly those ``json.dumps`` writes (``", "`` and
``": "``), whatever a schema's own ``x-guidance`` options say, so a model cannot loop on blanks.

A request carries its :class:`Grammar` in ``SamplingParams.grammar``; the engine core gives
each request its own :class:`GrammarState` (a matcher at the request's position). Every step,
the batched sampler masks the rows of constrained requests to the tokens their grammar
allows next (:func:`apply_grammar_masks`: one host bitmask for those rows, one copy, one
masked fill; rows without a grammar pay nothing), and the core advances each state with the
tokens it commits. A grammar that is complete allows only the stop ids, and ends its request.

Why llguidance: ``benchmarks/bench_grammar_libraries.py`` compares the three candidates on a
30-field schema and a 128k vocabulary (docs/benchmarks.md has the figures and the machine).
llguidance compiles the schema in about 3 ms and fills a mask in 30 µs p50 / 116 µs p99;
xgrammar takes about 63 ms and 94 / 1628 µs (its slow masks recur at every string value), and
outlines-core builds a 340 MiB index over the vocabulary in about 9 s and ignores an integer's
``minimum``. Beyond speed: xgrammar's string rule lets raw control characters through, which
``json.loads`` rejects (this project's tests found it). llguidance takes the vocabulary as
token byte strings, names what is wrong in a schema, and has no dependencies; xgrammar needs
transformers and triton at run time. (llguidance can also read a ``tokenizer.json`` itself,
but it guesses the byte reading from the decoder's type and refuses decoders it does not
know -- Metaspace, WordPiece, a Fuse sequence without byte fallback: "can't determine decoder
type". rtpcore gives it the bytes the tokenizer's own decoder writes instead.)

Speculative decoding: constrained requests decode without proposals (the draft would
have to follow the grammar too); the others in the batch keep speculating.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from rtpcore.errors import InvalidRequestError

__all__ = ["JSON_SEPARATORS", "Grammar", "GrammarCompiler", "GrammarState", "Vocabulary", "apply_grammar_masks"]

JSON_SEPARATORS = (", ", ": ")  # what json.dumps writes: the only whitespace the JSON grammars allow
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": JSON_SEPARATORS[0], "key_separator": JSON_SEPARATORS[1]}
_CACHE_SIZE = 128  # compiled schemas kept per compiler, and as many refused ones
PROBE_TOKENS = 8  # tokens a new grammar is walked at compile time to find what it cannot parse


class Grammar:
    """A compiled grammar over one compiler's vocabulary; immutable, shared by requests.
    ``source``: what it was compiled from (for messages); ``field``: the request field that
    asked for it; ``stop_token_ids``: the ids that may end it."""

    def __init__(self, compiler: GrammarCompiler, text: str, source: str, field: str | None = None):
        self._compiler = compiler
        self._text = text
        self.vocab_size = compiler.vocab_size
        self.stop_token_ids = compiler.stop_token_ids
        self.source = source
        self.field = field  # the request field it came from (response_format, tools), for messages
        self._prototype: Any = None  # the matcher at the start that state() copies
        self._lock = threading.Lock()

    def state(self) -> GrammarState:
        """A fresh matcher at the grammar's start, for one request: a copy of the one built
        when the grammar was first used (building one parses the grammar: 100 ms and more for
        a large schema; a copy takes well under a millisecond)."""
        import llguidance

        with self._lock:
            if self._prototype is None:
                self._prototype = llguidance.LLMatcher(self._compiler.tokenizer, self._text, log_level=0)
            return GrammarState(self._prototype.deep_copy())

    def __repr__(self) -> str:
        return f"Grammar({self.source})"


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any):
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it (the state
        then stays in error: nothing more is allowed)."""
        return bool(self._matcher.consume_token(int(token_id)))

    @property
    def error(self) -> str | None:
        """Why the grammar engine gave up on this grammar (the first line of its error), or
        None: llguidance stops a grammar whose parse grows past its limits (a schema too large
        or too recursive for it), and the request it constrains cannot go on. A grammar that
        only allows nothing more (it refuses every token: llguidance's NoExtensionBias) has not
        failed: its request ends there, as at a stop."""
        if not self._matcher.is_error():
            return None
        first = (self._matcher.get_error().strip().splitlines() or ["the grammar failed"])[0]
        return None if first.startswith("NoExtensionBias") else first

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete under the grammar (a stop id may end it now)."""
        return bool(self._matcher.is_accepting())

    @property
    def done(self) -> bool:
        """Whether the grammar is complete (it accepted a stop id, or nothing may follow)."""
        return bool(self._matcher.is_stopped())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of a CPU int32 bitmask."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)


class Vocabulary(Protocol):
    """What a compiler reads of a tokenizer (``rtpcore.engine.text.tokenizer.Tokenizer`` has it)."""

    @property
    def added_token_ids(self) -> frozenset[int]: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def text_start(self) -> str: ...

    def token_table(self) -> tuple[bytes, ...]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class GrammarCompiler:
    """Compiles grammars for one vocabulary: ``tokenizer`` (the checkpoint's
    :class:`~rtpcore.engine.text.tokenizer.Tokenizer`: its ``token_table`` gives each id's
    bytes), ``vocab_size`` (the model's logits width, at least the tokenizer's: the ids past the
    tokenizer's spell nothing) and ``stop_token_ids`` (the ids that may end a grammar)."""

    def __init__(self, tokenizer: Vocabulary, *, vocab_size: int, stop_token_ids: Iterable[int]):
        import llguidance
        import llguidance.torch  # its first import takes a second or more (torch.compile's import): here,
        # where the server builds the compiler off the event loop, not at a step's first mask

        stops = sorted(set(stop_token_ids))
        if not stops:
            raise ValueError("a grammar needs at least one stop token id to end")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stops)
        self.text_start = tokenizer.text_start
        table = _TokenTable(tokenizer, vocab_size, stops)
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), n_vocab=vocab_size, eos_token=stops)
        self._forcing = set(table.tokens) >= {bytes([b]) for b in range(256)}  # every byte a token (_after)
        table.greedy = self.tokenizer.greedy_tokenize
        self._cache: OrderedDict[str, Grammar | str] = OrderedDict()  # a str: why it was refused
        self._compiling: dict[str, threading.Event] = {}  # keys being compiled now; set once cached
        self._lock = threading.Lock()

    def json_object(self) -> Grammar:
        """Any JSON object (``response_format: {"type": "json_object"}``)."""
        return self.json_schema({"type": "object"}, field="response_format")

    def json_schema(self, schema: Any, *, field: str = "response_format") -> Grammar:
        """The grammar of JSON text valid under ``schema`` (a dict). An invalid or unsupported
        schema is an InvalidRequestError naming ``field`` and what is wrong."""
        import llguidance

        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"{field}: a JSON schema must be an object, got {type(schema).__name__}", field=field, value=schema
            )
        try:
            key = json.dumps(schema, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"{field}: the schema is not JSON: {exc}", field=field, value=schema) from None
        return self._compiled(
            f"{field}\0{key}", lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS),  # type: ignore[arg-type]
            f"JSON schema {key[:80]}", field, schema, "invalid or unsupported JSON schema",
        )

    def regex(self, pattern: str, *, field: str = "structured_outputs.regex") -> Grammar:
        """Text matching the regular expression ``pattern`` whole (llguidance's syntax, Rust's
        regex crate's); an invalid one is an InvalidRequestError naming ``field``."""
        import llguidance

        return self._compiled(f"regex\0{field}\0{pattern}", lambda: llguidance.LLMatcher.grammar_from_regex(pattern),
                              f"regex {pattern[:80]!r}", field, pattern, "invalid regular expression")

    def lark(self, grammar: str, *, field: str = "structured_outputs.grammar") -> Grammar:
        """Text of the Lark grammar ``grammar`` (llguidance's Lark dialect; its ``start`` rule)."""
        import llguidance

        return self._compiled(f"lark\0{field}\0{grammar}", lambda: llguidance.LLMatcher.grammar_from_lark(grammar),
                              f"grammar {grammar[:80]!r}", field, grammar, "invalid grammar")

    def choice(self, options: Sequence[str], *, field: str = "structured_outputs.choice") -> Grammar:
        """Exactly one of ``options`` (non-empty strings)."""
        if not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidRequestError(f"{field}: a list of one or more non-empty strings is needed",
                                      field=field, value=options)
        rule = " | ".join(json.dumps(o) for o in options)  # Lark string literals take JSON's escapes
        return self.lark(f"start: {rule}\n", field=field)

    def _compiled(self, cache_key: str, make_text: Any, source: str, field: str, value: Any, kind: str) -> Grammar:
        """The grammar ``make_text()`` writes, compiled, validated and probed once per key (a
        refusal is cached too: the same request is refused again without compiling). A call
        for a key another thread is compiling waits for that compile instead of repeating it
        (the same large schema sent by many clients at once is compiled once)."""
        while True:
            with self._lock:
                found = self._cache.get(cache_key)
                if found is not None:
                    self._cache.move_to_end(cache_key)
                    if isinstance(found, str):  # refused before: the same answer, not compiled again
                        raise InvalidRequestError(found, field=field, value=value)
                    return found
                compiling = self._compiling.get(cache_key)
                if compiling is None:  # this call compiles it; the calls for it meanwhile wait
                    compiling = self._compiling[cache_key] = threading.Event()
                    break
            compiling.wait()  # then the cache holds its result (or, if it raised, this call compiles)
        try:
            return self._compile(cache_key, make_text, source, field, value, kind)
        finally:
            with self._lock:
                del self._compiling[cache_key]
            compiling.set()

    def _compile(self, cache_key: str, make_text: Any, source: str, field: str, value: Any, kind: str) -> Grammar:
        import llguidance

        try:
            text = _after(self.text_start, make_text(), forcing=self._forcing)
            problem = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        except ValueError as exc:
            problem = str(exc)
        if problem:
            message = f"{field}: {kind}: {problem.strip().splitlines()[0]}"
        else:
            grammar = Grammar(self, text, source, field)
            found_problem = self.probe(grammar)
            message = f"{field}: {found_problem}" if found_problem else ""
        with self._lock:
            self._cache[cache_key] = message or grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        if message:
            raise InvalidRequestError(message, field=field, value=value)
        return grammar

    def probe(self, grammar: Grammar) -> str | None:
        """What makes ``grammar`` unusable, found by walking it for up to
        :data:`PROBE_TOKENS` tokens (the lowest allowed id each time), or None. llguidance
        validates a grammar's syntax at compile time but finds some problems only while it
        parses: a grammar no text satisfies (``{"$ref": "#"}``: only a stop id is allowed at
        once, and the grammar does not accept it) or one whose parse outgrows its limits (a
        required property that recurses into itself, thousands of properties). A request
        would fail on its first tokens; here it is refused before it runs."""
        state = grammar.state()
        words = (self.vocab_size + 31) // 32
        stops = set(self.stop_token_ids)
        for _ in range(PROBE_TOKENS):
            if state.done:
                return None
            mask = torch.zeros((1, words), dtype=torch.int32)
            state.fill(mask, 0)
            if state.error is not None:
                return _problem(state.error)
            allowed = _allowed(mask[0], self.vocab_size)
            if not allowed:
                return _UNSATISFIABLE
            token = next((t for t in allowed if t not in stops), None)
            if token is None:
                return None if state.accepting else _UNSATISFIABLE
            if not state.accept(token) or state.error is not None:
                return _problem(state.error or "the grammar refused a token it allowed")
        return None


class _TokenTable:
    """What ``llguidance.TokenizerWrapper`` reads: each id's bytes (``Tokenizer.token_table``;
    added and special tokens behind llguidance's special-token mark, 0xFF, so no grammar
    writes them; ids past the tokenizer's spell nothing), the special ids, and an encoder.

    llguidance encodes the text a grammar forces and expects ids whose bytes are that text.
    The tokenizer's own encoding is used when they are; otherwise (a SentencePiece or
    Metaspace tokenizer prepends its ``▁``: ``"{"`` encodes to ``"▁{"``, which writes ``" {"``)
    llguidance's greedy encoding over the same table (``greedy``, set once it is built)."""

    greedy: Any = None

    def __init__(self, tokenizer: Vocabulary, vocab_size: int, stops: Sequence[int]):
        added = tokenizer.added_token_ids
        table = tokenizer.token_table()
        self.tokens = [b"\xff" + t if i in added else t for i, t in enumerate(table[:vocab_size])]
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self.special_token_ids = sorted(i for i in added if i < vocab_size)
        self.eos_token_id = stops[0]
        self.bos_token_id = tokenizer.bos_token_id
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper tries bytes once: this encoder takes text only
            raise TypeError(f"expected text, got {type(text).__name__}")
        ids = self._encode(text, add_special_tokens=False)
        if self.greedy is None or (all(0 <= i < len(self.tokens) for i in ids)
                                   and b"".join(self.tokens[i] for i in ids) == text.encode()):
            return ids
        return list(self.greedy(text))


def _after(start: str, text: str, *, forcing: bool) -> str:
    """The grammar ``text`` (llguidance's JSON form or Lark) preceded by the literal ``start``
    (``Tokenizer.text_start``: a WordPiece tokenizer's first token writes its leading space
    only after other text, so the grammar, which reads each token's bytes after text, sees that
    space first) and, unless ``forcing``, with llguidance's forced-bytes shortcut off: it
    encodes the bytes a grammar forces and takes the ids as spelling them exactly, which holds
    only for a vocabulary where every byte is a token (byte-level BPE, byte fallback). A
    WordPiece vocabulary cannot spell a lone ``" "`` (its spaces come with the next word), and
    the shortcut then allows tokens as if the space were written. ``text`` itself when there is
    nothing to add."""
    if not start and forcing:
        return text
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("grammars"), list) and parsed["grammars"]:
        grammars, body = parsed["grammars"], str(parsed["grammars"][0]["name"])
    else:  # Lark
        parsed, grammars, body = {}, [{"name": "body", "lark_grammar": text}], "body"
    options = "" if forcing else '%llguidance {"no_forcing": true}\n'
    lead = {"name": "text_start", "lark_grammar": f"{options}start: {json.dumps(start) + ' ' if start else ''}@{body}"}
    return json.dumps({**parsed, "grammars": [lead, *grammars]})


_UNSATISFIABLE = "the schema allows no text: nothing can satisfy it (a reference to itself with no way out?)"


def _problem(error: str) -> str:
    """A grammar engine's parse error as the reason a schema is refused."""
    return f"the schema is too large or too deeply recursive for the grammar engine ({error[:200]})"


def _allowed(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row (int32 words, bit i of word w: id 32 w + i) allows."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((row[:, None] >> shifts) & 1).bool().reshape(-1)[:vocab_size]
    return bits.nonzero().flatten().tolist()


def apply_grammar_masks(x: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """``x`` (N, V) with every token row ``b``'s grammar (``states[b]``) does not allow next
    set to -inf; rows without a state are unchanged (and the whole call is free when no row
    has one). Returns a new tensor when any row is masked."""
    rows = [b for b, s in enumerate(states) if s is not None]
    if not rows:
        return x
    v = x.shape[1]
    words = (v + 31) // 32
    host = torch.zeros((len(rows), words), dtype=torch.int32)
    for j, b in enumerate(rows):
        state = states[b]
        assert state is not None
        state.fill(host, j)
    bits = host.to(x.device, non_blocking=True) if x.device.type != "cpu" else host
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(rows), words * 32)[:, :v]
    index = torch.tensor(rows, dtype=torch.int64, device=x.device)
    masked = x.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return x.index_copy(0, index, masked)
