"""Grammar libraries for constrained decoding (JSON-schema structured outputs, OpenAI's
``response_format``): xgrammar, llguidance and outlines-core on the same schema and vocabulary.

    python benchmarks/bench_grammar_libraries.py [--vocab-size 128000] [--fields 30] [--runs 3]
        [--walks 5] [--seed 0] [--quick] [--libraries xgrammar,llguidance,outlines-core]
        [--compile-threads N] [--timeout 1800]

Builds, in-process and seeded, a byte-level-BPE-like vocabulary of ``--vocab-size`` tokens: the
256 single bytes, then multi-byte tokens drawn from an English-like and JSON-like corpus (words
with and without a leading space, capitalised, quoted keys such as ``"name`` and ``name":``,
word pieces, digit runs, JSON punctuation runs such as ``",`` ``":`` ``{"``, whitespace runs,
accented words, CJK and Cyrillic characters, emoji, and partial UTF-8 sequences that are not
valid UTF-8 on their own), shuffled, and one EOS token (the last id). Every library gets the
same tokens as raw bytes: xgrammar ``TokenizerInfo(vocab_type=RAW, stop_token_ids=[eos])``,
llguidance ``LLTokenizer(TokenizerWrapper(...))`` with the EOS marked special, outlines-core
``Vocabulary(eos, {bytes: [id]})`` (EOS by id only: it refuses the EOS token in the map).

The schema is an object of ``--fields`` required properties of mixed types (strings, strings
with min/maxLength, integers, integers with minimum/maximum, numbers, booleans, string enums,
an array of strings with min/maxItems, a nested object; ``additionalProperties: false``
everywhere, no ``pattern`` or ``format``), compiled with no free whitespace and the compact
separators ``,`` and ``:`` (xgrammar ``any_whitespace=False, separators=(",", ":")``;
llguidance ``whitespace_flexible: false, item_separator ",", key_separator ":"``;
outlines-core ``whitespace_pattern=""``). The separators each compiled grammar then allows are
probed (which of ``,`` ``, `` ``: `` and whitespace tokens its matcher accepts after a value,
after a key and at the start) and printed.

Each library runs in its own subprocess (one after the other, so that neither memory nor
caches nor a crash leak between them; a library that fails to import, compile or walk is
reported in its row and the others still run). Per library it times:

1. compile, cold: schema to a ready matcher with a fresh compiler (xgrammar: a new
   ``GrammarCompiler`` each run, ``--compile-threads`` threads; llguidance:
   ``grammar_from_json_schema`` then ``LLMatcher``; outlines-core:
   ``build_regex_from_schema`` then ``Index`` then ``Guide``), median of ``--runs``, wall and
   CPU time (CPU > wall means it used several threads); the one-off tokenizer setup is timed
   apart. Warm: what each offers for the same schema again, median of ``--runs``: xgrammar's
   compiler cache (a hit, plus ``GrammarMatcher``), llguidance ``deep_copy`` of a kept
   matcher (it has no compile cache), outlines-core a new ``Guide`` over the kept ``Index``.
2. per-token mask cost: one instance of the schema (seeded) is serialised with the compact
   separators and tokenised greedily (longest match) with the synthetic vocabulary; each walk
   takes a fresh warm matcher and, at every step, times the fill of the full allowed-token
   bitmask (``(1, ceil(V/32))`` int32, the form a sampler applies: xgrammar
   ``fill_next_token_bitmask``, ``llguidance.torch.fill_next_token_bitmask``,
   ``outlines_core.kernels.torch.fill_next_token_bitmask``) then advances with the document's
   token (timed apart); the last mask is the one where EOS must be the only choice. The first
   walk (lazy caches still cold) is reported apart as a total; over the other ``--walks`` each
   step's median is taken (a step preempted on a shared machine does not become the p99; the
   pooled raw p99 and max are printed below the table), and their mean, p50, p99 and sum (the
   cost of the masks of one document) are reported. Also printed: how many masks allow a single
   token (llguidance masks a forced stretch of bytes, such as ``,"name":``, down to its
   canonical tokenisation, so those steps are cheap for it) and the p50 over the other steps;
   for outlines-core, the path via ``Index.get_allowed_tokens`` turned into a bool mask.
3. applying each mask of a walk to a ``(1, V)`` float32 logits tensor (one torch thread), p50:
   for every library eager torch (unpack the bitmask to bool, ``masked_fill_``; the bitmask
   format is the same for all three, and the llguidance and outlines-core helpers are
   ``torch.compile`` kernels), and for xgrammar its own ``apply_token_bitmask_inplace`` (CPU).
4. memory: growth of the worker's peak RSS over the first cold compile, and the size the
   library reports (xgrammar ``memory_size_bytes``, outlines-core's pickled ``Index``).

Correctness, per library: every document token must be in the mask before it is accepted, the
walk must end accepting with EOS allowed (and alone), and a few wrong tokens must be rejected
both by the mask and by the matcher: whitespace at the start, after ``:``, after ``,`` and
before ``,``; a string where an integer goes; ``-`` under ``minimum: 0``; a letter outside an
enum; ``null`` for a boolean; a property after the last; EOS mid-document.

It prints the CPU line (``bench_decode.py``'s), the load average (the times are wall times on
a shared machine), the library versions, one markdown table (a row per library), the
separators and failed checks, and a recommendation computed from the numbers: among the
libraries that pass every check, the cost per request for a new schema (cold compile + first
walk) and for a cached schema (warm + the steady walk), and the per-mask p50/p99; the pick is
the cheapest for a new schema, unless another is over 2x cheaper with cached schemas and
within 2x for new ones.
``--quick`` uses an 8000-token vocabulary, one compile run and two walks; explicit options
win over it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import pickle
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LIBRARIES = ("xgrammar", "llguidance", "outlines-core")
DISTRIBUTIONS = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines-core": "outlines_core"}
EOS_BYTES = b"<|eos|>"
ITEM_SEP, KEY_SEP = ",", ":"

# ---------------------------------------------------------------- vocabulary

COMMON_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "they", "you", "were", "her", "one", "all", "we", "there", "can", "been", "has", "more", "if",
    "will", "would", "their", "so", "what", "about", "when", "who", "other", "its", "into", "time",
    "only", "some", "could", "new", "these", "two", "may", "first", "then", "do", "any", "like",
    "my", "now", "over", "such", "our", "man", "me", "even", "most", "made", "after", "also", "did",
    "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well",
    "down", "should", "because", "each", "just", "those", "people", "how", "too", "little", "state",
    "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get", "here",
    "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while",
    "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came",
    "right", "used", "take", "three", "name", "email", "address", "city", "country", "phone",
    "status", "type", "value", "data", "user", "id", "created", "updated", "date", "title",
    "description", "price", "count", "total", "score", "rating", "active", "enabled", "verified",
    "published", "category", "tags", "labels", "items", "list", "owner", "version", "notes",
    "comment", "summary", "keywords", "location", "quantity", "weight", "height", "width",
    "priority", "level", "code", "message", "error", "result", "response", "request", "order",
    "product", "customer", "account", "number", "street", "zip", "postal", "region", "currency",
    "amount", "balance", "start", "end", "duration", "source", "target", "group", "member", "role",
    "permission", "token", "session", "language", "timezone", "color", "size", "model", "brand",
    "image", "url", "link", "file", "path", "format", "content", "text", "body", "author", "editor",
    "reviewer", "department", "company", "manager", "team", "project", "task", "due", "completed",
    "progress", "percent", "rank", "index", "key", "metadata", "config", "option", "setting",
    "mode", "flag", "note", "first", "last", "middle", "full", "display", "nick", "age", "birth",
    "gender", "height", "true", "false", "null", "yes", "no", "unknown", "pending", "approved",
    "rejected", "draft", "archived", "deleted", "red", "green", "blue", "black", "white", "small",
    "medium", "large", "high", "low", "normal", "urgent", "north", "south", "east", "west",
)
ACCENTED = (
    "café", "naïve", "résumé", "déjà", "vu", "façade", "jalapeño", "über", "straße", "zürich",
    "münchen", "kölner", "españa", "niño", "señor", "açúcar", "coração", "são", "paulo", "crème",
    "brûlée", "fiancé", "rôle", "élève", "garçon",
)
JSON_PUNCT = "{}[]:,\" \n\t"


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "ch", "sh", "qu", "ng", "st", "er", "an"]
    out: dict[str, None] = {}
    while len(out) < n:
        out["".join(rng.choices(syllables, k=rng.randint(1, 4)))] = None
    return list(out)


def build_vocab(size: int, seed: int) -> tuple[list[bytes], int]:
    """``size`` distinct tokens as raw bytes: ids 0-255 are the single bytes, the last id is EOS,
    the rest multi-byte tokens of a seeded English/JSON-like corpus (shuffled)."""
    if size < 1024:
        raise ValueError("--vocab-size must be at least 1024")
    rng = random.Random(seed)
    want = size - 256 - 1
    toks: dict[bytes, None] = {}

    def add(text: str | bytes) -> None:
        b = text.encode() if isinstance(text, str) else text
        if len(b) > 1 and b != EOS_BYTES:
            toks[b] = None

    words = list(COMMON_WORDS)
    for w in words:  # word forms a byte-level BPE learns from English and JSON
        for form in (w, w.capitalize(), w.upper()):
            add(form)
            add(" " + form)
        add('"' + w)
        add(w + '"')
        add(w + '":')
        add('"' + w + '":')
        add("_" + w)
        add(w + "_")
    for a in words[:120]:  # snake_case keys
        for b in rng.sample(words, 6):
            add(a + "_" + b)
            add('"' + a + "_" + b + '":')
    for i in range(1000):
        add(str(i))
    for i in range(100):
        add(" " + str(i))
        add(str(i) + ",")
        add("." + str(i))
    for y in range(1900, 2100):
        add(str(y))
    for a in JSON_PUNCT:  # punctuation runs: '",' '":' '{"' '"}' '},' ...
        for b in JSON_PUNCT:
            add(a + b)
            for c in JSON_PUNCT:
                if rng.random() < 0.5:
                    add(a + b + c)
    for k in range(2, 33):
        add(" " * k)
        add("\n" + " " * (k - 2))
        add("\t" * min(k, 8))
    for w in ACCENTED:
        add(w)
        add(" " + w)
        add(w.capitalize())
    cjk = [chr(c) for c in rng.sample(range(0x4E00, 0x9FA5), 3000)]
    for ch in cjk[:2500]:  # 3-byte characters, and pairs of them
        add(ch)
    for _ in range(800):
        add("".join(rng.sample(cjk, 2)))
    for ch in cjk[2500:]:  # partial UTF-8: byte-level BPE merges bytes, not characters
        add(ch.encode()[:2])
        add(ch.encode()[1:])
    for c in range(0x0410, 0x0450):  # Cyrillic letters and pairs
        add(chr(c))
        add(chr(c) + chr(rng.randint(0x0430, 0x044F)))
    for c in rng.sample(range(0x1F300, 0x1F64F), 300):  # 4-byte emoji
        add(chr(c))
        add(" " + chr(c))
    pseudo = _pseudo_words(rng, 60000)
    for p in pseudo:
        add(p)
        add(" " + p)
        if len(toks) >= want * 3 // 2:
            break
    while len(toks) < want:  # word pieces of the corpus until the vocabulary is full
        p = rng.choice(pseudo)
        i = rng.randrange(len(p))
        add(p[i : i + rng.randint(2, 6)])
    multi = list(toks)[:want]
    rng.shuffle(multi)
    vocab = [bytes([i]) for i in range(256)] + multi + [EOS_BYTES]
    return vocab, len(vocab) - 1


class GreedyTokenizer:
    """Longest-match tokenisation over the vocabulary (EOS excluded): every byte is a token, so
    any byte string tokenises; the grammars accept any tokenisation of a valid prefix."""

    def __init__(self, vocab: list[bytes], eos: int):
        self.ids = {t: i for i, t in enumerate(vocab) if i != eos}
        self.longest = max(len(t) for t in self.ids)

    def encode(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                tid = self.ids.get(data[i : i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
        return out


# ---------------------------------------------------------------- schema and document

KINDS = ("string", "integer_range", "number", "boolean", "enum", "string_length", "array",
         "object", "integer", "string_unicode")
FIELD_NAMES = (
    "id", "name", "email", "age", "score", "active", "status", "title", "tags", "address", "count",
    "description", "price", "verified", "category", "nickname", "labels", "location", "quantity",
    "notes", "rating", "enabled", "priority", "summary", "keywords", "owner", "version", "comment",
    "weight", "published",
)


def build_schema(fields: int) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The schema and its (name, kind) fields, in declaration order."""
    props: dict[str, Any] = {}
    layout = []
    for i in range(fields):
        kind = KINDS[i % len(KINDS)]
        name = FIELD_NAMES[i] if i < len(FIELD_NAMES) else f"{FIELD_NAMES[i % len(FIELD_NAMES)]}_{i}"
        if kind in ("string", "string_unicode"):
            s: dict[str, Any] = {"type": "string"}
        elif kind == "string_length":
            s = {"type": "string", "minLength": 3, "maxLength": 40}
        elif kind == "integer_range":
            s = {"type": "integer", "minimum": 0, "maximum": 150}
        elif kind == "integer":
            s = {"type": "integer"}
        elif kind == "number":
            s = {"type": "number"}
        elif kind == "boolean":
            s = {"type": "boolean"}
        elif kind == "enum":
            s = {"type": "string", "enum": ["active", "pending", "archived", "deleted"]}
        elif kind == "array":
            s = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 8}
        else:
            s = {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "verified": {"type": "boolean"},
                },
                "required": ["street", "zip", "verified"],
                "additionalProperties": False,
            }
        props[name] = s
        layout.append((name, kind))
    schema = {
        "type": "object",
        "properties": props,
        "required": [n for n, _ in layout],
        "additionalProperties": False,
    }
    return schema, layout


def build_instance(layout: list[tuple[str, str]], seed: int) -> dict[str, Any]:
    rng = random.Random(seed + 1)
    words = COMMON_WORDS

    def phrase(lo: int, hi: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(lo, hi)))

    out: dict[str, Any] = {}
    for name, kind in layout:
        if kind == "string":
            out[name] = phrase(2, 9).capitalize() + rng.choice(["", ".", '; "quoted"', "!"])
        elif kind == "string_unicode":
            out[name] = rng.choice(ACCENTED) + " " + "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(3)) + " " + chr(rng.randint(0x1F300, 0x1F64F))
        elif kind == "string_length":
            out[name] = phrase(1, 4)[:40].ljust(3, "x")
        elif kind == "integer_range":
            out[name] = rng.randint(0, 150)
        elif kind == "integer":
            out[name] = rng.randint(-10**6, 10**9)
        elif kind == "number":
            out[name] = round(rng.uniform(-1000, 1000), rng.randint(1, 4))
        elif kind == "boolean":
            out[name] = rng.random() < 0.5
        elif kind == "enum":
            out[name] = rng.choice(["active", "pending", "archived", "deleted"])
        elif kind == "array":
            out[name] = [phrase(1, 3) for _ in range(rng.randint(1, 5))]
        else:
            out[name] = {"street": phrase(2, 4).title(), "zip": rng.randint(0, 99999), "verified": rng.random() < 0.5}
    return out


def dump(obj: Any) -> str:
    return json.dumps(obj, separators=(ITEM_SEP, KEY_SEP), ensure_ascii=False)


def value_offset(instance: dict[str, Any], index: int) -> int:
    """Byte offset in the compact document where the value of field ``index`` starts."""
    items = list(instance.items())
    head = "{" + ITEM_SEP.join(dump(k) + KEY_SEP + dump(v) for k, v in items[:index])
    head += (ITEM_SEP if index else "") + dump(items[index][0]) + KEY_SEP
    return len(head.encode())


def wrong_token_checks(instance: dict[str, Any], layout: list[tuple[str, str]],
                       doc: bytes) -> list[tuple[str, bytes, bytes | None]]:
    """(name, document prefix, wrong token bytes; None is EOS) the grammar must reject."""
    first = {}
    for i, (_, kind) in enumerate(layout):
        first.setdefault(kind, i)
    v0 = value_offset(instance, 0)
    end0 = v0 + len(dump(instance[layout[0][0]]).encode())
    checks = [
        ("space at start", b"", b" "),
        ("newline at start", b"", b"\n"),
        ("space after ':'", doc[:v0], b" "),
        ("space before ','", doc[:end0], b" "),
    ]
    if len(layout) > 1:
        after_comma = end0 + len(ITEM_SEP)
        checks += [("space after ','", doc[:after_comma], b" "), ("newline after ','", doc[:after_comma], b"\n")]
    if "integer_range" in first:
        off = value_offset(instance, first["integer_range"])
        checks += [("string for integer", doc[:off], b'"'), ("'-' under minimum 0", doc[:off], b"-")]
    if "enum" in first:
        off = value_offset(instance, first["enum"]) + 1  # after the opening quote
        checks.append(("letter outside enum", doc[:off], b"z"))
    if "boolean" in first:
        checks.append(("null for boolean", doc[: value_offset(instance, first["boolean"])], b"n"))
    checks.append(("property after last", doc[:-1], ITEM_SEP.encode()))
    checks.append(("EOS mid-document", doc[: len(doc) // 2], None))
    return checks


# ---------------------------------------------------------------- libraries


def _unpack(bitmask: Any, vocab_size: int) -> Any:
    import torch

    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(bitmask.shape[0], -1)[:, :vocab_size]


def eager_apply(logits: Any, bitmask: Any) -> None:
    """Unpack the int32 bitmask to bool and ``masked_fill_`` the rejected logits (eager torch)."""
    logits.masked_fill_(~_unpack(bitmask, logits.shape[-1]), float("-inf"))


class Backend:
    """One library behind the operations the benchmark times."""

    name = ""
    apply_own: Callable[[Any, Any], None] | None = None  # the library's own eager CPU apply, if any

    def __init__(self, vocab: list[bytes], eos: int, tokenizer: GreedyTokenizer, threads: int):
        self.vocab, self.eos, self.tokenizer, self.threads = vocab, eos, tokenizer, threads
        self.notes: list[str] = []

    def load(self) -> None: ...
    def setup(self) -> None: ...
    def compile_cold(self, schema: str) -> Any: ...
    def compile_warm(self, schema: str) -> Any: ...
    def fill(self, matcher: Any, bitmask: Any) -> None: ...
    def advance(self, matcher: Any, token: int) -> bool: ...
    def rejects(self, matcher: Any, token: int) -> bool: ...
    def accepting(self, matcher: Any) -> bool: ...
    def finish(self, matcher: Any) -> bool: ...
    def reported_bytes(self) -> int | None:
        return None

    def alt_mask(self, matcher: Any) -> Any:
        return None


class XGrammar(Backend):
    name = "xgrammar"

    def load(self) -> None:
        import xgrammar

        self.xgr = xgrammar

    def setup(self) -> None:
        xgr = self.xgr
        self.info = xgr.TokenizerInfo(encoded_vocab=self.vocab, vocab_type=xgr.VocabType.RAW,
                                      stop_token_ids=[self.eos])
        self.compiler: Any = None
        self.compiled: Any = None
        self.notes.append(f"GrammarCompiler(max_threads={self.threads}); cache on")

    def _compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(ITEM_SEP, KEY_SEP))

    def compile_cold(self, schema: str) -> Any:
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=True)
        self.compiled = self._compile(schema)
        return self.xgr.GrammarMatcher(self.compiled)

    def compile_warm(self, schema: str) -> Any:
        return self.xgr.GrammarMatcher(self._compile(schema))

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def rejects(self, matcher: Any, token: int) -> bool:
        return not matcher.fork().accept_token(token)

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_completed())

    def finish(self, matcher: Any) -> bool:
        return bool(matcher.accept_token(self.eos)) and bool(matcher.is_terminated())

    def reported_bytes(self) -> int | None:
        return int(self.compiled.memory_size_bytes)

    def apply_own(self, logits: Any, bitmask: Any) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class _Tokens:
    """The object ``llguidance.TokenizerWrapper`` wraps: the tokens as bytes, EOS, and an encoder
    (used by llguidance only for its own tokenize_* helpers)."""

    def __init__(self, vocab: list[bytes], eos: int, tokenizer: GreedyTokenizer):
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = vocab
        self.special_token_ids = [eos]
        self._tokenizer = tokenizer

    def __call__(self, data: bytes) -> list[int]:
        return self._tokenizer.encode(data)


class LLGuidance(Backend):
    name = "llguidance"

    def load(self) -> None:
        import llguidance
        import llguidance.torch

        self.llg, self.llgt = llguidance, llguidance.torch

    def setup(self) -> None:
        self.tok = self.llg.LLTokenizer(self.llg.TokenizerWrapper(_Tokens(self.vocab, self.eos, self.tokenizer)))
        self.template: Any = None
        self.notes.append("default slices; warm = deep_copy of a kept matcher (no compile cache)")

    def compile_cold(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False, "item_separator": ITEM_SEP, "key_separator": KEY_SEP})
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        self.template = matcher.deep_copy()
        return matcher

    def compile_warm(self, schema: str) -> Any:
        return self.template.deep_copy()

    def fill(self, matcher: Any, bitmask: Any) -> None:
        self.llgt.fill_next_token_bitmask(matcher, bitmask)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def rejects(self, matcher: Any, token: int) -> bool:
        return not matcher.deep_copy().consume_token(token)

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())

    def finish(self, matcher: Any) -> bool:
        return bool(matcher.consume_token(self.eos)) and not matcher.is_error() and bool(matcher.is_stopped())


class OutlinesCore(Backend):
    name = "outlines-core"

    def load(self) -> None:
        import outlines_core
        import outlines_core.kernels.torch

        self.oc, self.ock = outlines_core, outlines_core.kernels.torch

    def setup(self) -> None:
        self.vocabulary = self.oc.Vocabulary(self.eos, {t: [i] for i, t in enumerate(self.vocab) if i != self.eos})
        self.index: Any = None
        self.notes.append("EOS passed by id only (Vocabulary refuses it in the token map); warm = new Guide over the kept Index")

    def compile_cold(self, schema: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(schema, whitespace_pattern="")
        self.index = self.oc.Index(regex, self.vocabulary)
        return self.oc.Guide(self.index)

    def compile_warm(self, schema: str) -> Any:
        return self.oc.Guide(self.index)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        self.ock.fill_next_token_bitmask(matcher, bitmask)

    def advance(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rejects(self, matcher: Any, token: int) -> bool:
        return not matcher.accepts_tokens([token]) and self.index.get_next_state(matcher.get_state(), token) is None

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_finished())

    def finish(self, matcher: Any) -> bool:  # an Index has no transition on EOS: the sampler stops
        return self.index.is_final_state(matcher.get_state()) and self.eos in matcher.get_tokens()

    def reported_bytes(self) -> int | None:
        try:
            return len(pickle.dumps(self.index))
        except Exception:
            return None

    def alt_mask(self, matcher: Any) -> Any:
        import torch

        mask = torch.zeros(len(self.vocab), dtype=torch.bool)
        mask[torch.tensor(self.index.get_allowed_tokens(matcher.get_state()), dtype=torch.long)] = True
        return mask


BACKENDS: dict[str, type[Backend]] = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


# ---------------------------------------------------------------- worker


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@contextlib.contextmanager
def stopwatch(into: list[tuple[float, float]]) -> Iterator[None]:
    w, c = time.perf_counter(), time.process_time()
    yield
    into.append((time.perf_counter() - w, time.process_time() - c))


def is_set(bitmask: Any, token: int) -> bool:
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


def popcount(bitmask: Any, vocab_size: int) -> int:
    return int(_unpack(bitmask, vocab_size).sum())


def run_worker(lib: str, args: argparse.Namespace, res: dict[str, Any]) -> None:
    """Fills ``res`` as it goes, so that a failure still reports what was measured."""
    import torch

    torch.set_num_threads(1)
    res["stage"] = "vocabulary"
    vocab, eos = build_vocab(args.vocab_size, args.seed)
    tokenizer = GreedyTokenizer(vocab, eos)
    schema, layout = build_schema(args.fields)
    schema_str = json.dumps(schema)
    instance = build_instance(layout, args.seed)
    doc = dump(instance).encode()
    doc_tokens = tokenizer.encode(doc)
    V = len(vocab)
    res.update(vocab_size=V, doc_bytes=len(doc), doc_tokens=len(doc_tokens),
               non_utf8_tokens=sum(1 for t in vocab if not _utf8(t)))
    backend = BACKENDS[lib](vocab, eos, tokenizer, args.compile_threads)
    failures: list[str] = []
    res["failures"] = failures

    res["stage"] = "import"
    t = time.perf_counter()
    backend.load()
    res["import_s"] = time.perf_counter() - t
    res["stage"] = "tokenizer setup"
    t = time.perf_counter()
    backend.setup()
    res["setup_s"] = time.perf_counter() - t

    res["stage"] = "compile"
    cold: list[tuple[float, float]] = []
    rss0 = peak_rss()
    for i in range(args.runs):
        with stopwatch(cold):
            backend.compile_cold(schema_str)
        if i == 0:
            res["rss_growth"] = peak_rss() - rss0
    warm: list[tuple[float, float]] = []
    for _ in range(args.runs):
        with stopwatch(warm):
            backend.compile_warm(schema_str)
    res["cold_first_s"] = cold[0][0]
    res["cold_s"] = statistics.median(w for w, _ in cold)
    res["cold_cpu_s"] = statistics.median(c for _, c in cold)
    res["warm_s"] = statistics.median(w for w, _ in warm)
    res["reported_bytes"] = backend.reported_bytes()

    res["stage"] = "walk"
    bitmask = torch.full((1, (V + 31) // 32), -1, dtype=torch.int32)
    steady: list[list[float]] = []  # per timed walk, per step
    advances: list[float] = []
    alt: list[float] = []
    saved: list[Any] = []
    for walk in range(args.walks + 1):
        matcher = backend.compile_warm(schema_str)
        times: list[float] = []
        ok = True
        for step, tok in enumerate([*doc_tokens, None]):
            t0 = time.perf_counter_ns()
            backend.fill(matcher, bitmask)
            times.append((time.perf_counter_ns() - t0) / 1e3)
            if walk == 1:
                saved.append(bitmask.clone())
                t0 = time.perf_counter_ns()
                alt_mask = backend.alt_mask(matcher)
                if alt_mask is not None:
                    alt.append((time.perf_counter_ns() - t0) / 1e3)
                    if not torch.equal(alt_mask, _unpack(bitmask, V)[0]):
                        failures.append(f"Index.get_allowed_tokens differs from the bitmask at step {step}")
            if tok is None:
                break
            if walk == 0 and not is_set(bitmask, tok):
                failures.append(f"document token {step} ({vocab[tok]!r}) not in the mask")
            t0 = time.perf_counter_ns()
            accepted = backend.advance(matcher, tok)
            advances.append((time.perf_counter_ns() - t0) / 1e3)
            if not accepted:
                failures.append(f"document token {step} ({vocab[tok]!r}) rejected")
                ok = False
                break
        if walk == 0:
            res["first_mask_us"] = times[0]
            res["first_walk_ms"] = sum(times) / 1e3
            if ok:
                if not backend.accepting(matcher):
                    failures.append("not accepting at the end of the document")
                allowed = popcount(bitmask, V)
                if not is_set(bitmask, eos) or allowed != 1:
                    failures.append(f"final mask: EOS {'allowed' if is_set(bitmask, eos) else 'NOT allowed'}, {allowed} tokens allowed")
                if not backend.finish(matcher):
                    failures.append("EOS not accepted at the end")
        else:
            steady.append(times)
        if not ok:
            break
    if steady:
        # Each step's median over the timed walks: a preempted step on a shared machine does not
        # become the p99; the raw pooled figures are kept too.
        per_step = [statistics.median(xs) for xs in zip(*steady, strict=True)]
        pooled = [x for times in steady for x in times]
        res.update(mask_mean_us=statistics.fmean(per_step), mask_p50_us=percentile(per_step, 0.5),
                   mask_p99_us=percentile(per_step, 0.99), mask_max_us=max(per_step),
                   doc_ms=sum(per_step) / 1e3, masks_per_walk=len(per_step),
                   raw_p99_us=percentile(pooled, 0.99), raw_max_us=max(pooled),
                   raw_doc_ms=statistics.median(sum(times) / 1e3 for times in steady))
        if len(saved) == len(per_step):
            counts = [popcount(bm, V) for bm in saved]
            res["single_token_masks"] = sum(1 for c in counts if c == 1)
            res["median_allowed"] = statistics.median(counts)
            multi = [t for t, c in zip(per_step, counts, strict=True) if c > 1]
            if multi:
                res["multi_p50_us"] = percentile(multi, 0.5)
    if advances:
        res["advance_p50_us"] = percentile(advances, 0.5)
    if alt:
        res["alt_p50_us"] = percentile(alt, 0.5)

    res["stage"] = "apply"
    if saved:
        base = torch.randn(1, V, generator=torch.Generator().manual_seed(args.seed))
        for key, apply in (("apply_eager_p50_us", eager_apply), ("apply_own_p50_us", backend.apply_own)):
            if apply is None:
                continue
            apply_us = []
            for bm in saved:
                logits = base.clone()
                t0 = time.perf_counter_ns()
                apply(logits, bm)
                apply_us.append((time.perf_counter_ns() - t0) / 1e3)
                if int(torch.isfinite(logits).sum()) != popcount(bm, V):
                    failures.append(f"{key}: applied logits disagree with the bitmask")
                    break
            res[key] = percentile(apply_us, 0.5)

    res["stage"] = "checks"
    res["separators"] = probe_separators(backend, schema_str, instance, doc, tokenizer, bitmask, eos)
    passed = 0
    checks = wrong_token_checks(instance, layout, doc)
    for name, prefix, wrong in checks:
        verdict = check_rejects(backend, schema_str, tokenizer, prefix, wrong, eos, bitmask)
        if verdict:
            failures.append(f"wrong token accepted: {name} ({verdict})")
        else:
            passed += 1
    res["checks"] = f"{passed}/{len(checks)}"
    res["notes"] = backend.notes
    res["stage"] = "done"


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _walk_prefix(backend: Backend, schema_str: str, tokenizer: GreedyTokenizer, prefix: bytes) -> Any:
    matcher = backend.compile_warm(schema_str)
    for tok in tokenizer.encode(prefix):
        if not backend.advance(matcher, tok):
            raise RuntimeError(f"prefix {prefix[-20:]!r} rejected")
    return matcher


def check_rejects(backend: Backend, schema_str: str, tokenizer: GreedyTokenizer, prefix: bytes,
                  wrong: bytes | None, eos: int, bitmask: Any) -> str:
    """'' when both the mask and the matcher reject the token after ``prefix``; else what let it in."""
    matcher = _walk_prefix(backend, schema_str, tokenizer, prefix)
    tok = eos if wrong is None else tokenizer.ids[wrong]
    backend.fill(matcher, bitmask)
    culprits = []
    if is_set(bitmask, tok):
        culprits.append("mask")
    if not backend.rejects(matcher, tok):
        culprits.append("matcher")
    return " and ".join(culprits)


def probe_separators(backend: Backend, schema_str: str, instance: dict[str, Any], doc: bytes,
                     tokenizer: GreedyTokenizer, bitmask: Any, eos: int) -> str:
    """Which separator and whitespace tokens the matcher accepts between a value and the next
    key, between a key and its value, and at the start (by the matcher, not the mask: llguidance
    masks a forced stretch of bytes down to its canonical tokenisation, e.g. ``,"`` alone)."""
    def allowed(prefix: bytes, candidates: list[bytes]) -> list[str]:
        matcher = _walk_prefix(backend, schema_str, tokenizer, prefix)
        return [json.dumps(c.decode()) for c in candidates
                if c in tokenizer.ids and not backend.rejects(matcher, tokenizer.ids[c])]

    first_key = next(iter(instance))
    v0 = value_offset(instance, 0)
    end0 = v0 + len(dump(instance[first_key]).encode())
    key_end = v0 - len(KEY_SEP)
    space = [b" ", b"\n", b"\t", b"\r"]
    after_value = allowed(doc[:end0], [b",", b", ", b",\n", *space])
    after_key = allowed(doc[:key_end], [b":", b": ", *space])
    start = allowed(b"", [b"{", *space])
    return (f"after a value: {' '.join(after_value) or 'none'}; after a key: {' '.join(after_key) or 'none'}; "
            f"at the start: {' '.join(start) or 'none'}")


# ---------------------------------------------------------------- driver


def _bench_decode() -> Any:
    """benchmarks/bench_decode.py as a module (for ``cpu_line``), loaded by path."""
    spec = importlib.util.spec_from_file_location("bench_decode", HERE / "bench_decode.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_line() -> str:
    try:
        line = _bench_decode().cpu_line()
    except Exception as exc:  # rtpcore not importable: the model name alone
        model = "unknown CPU"
        with contextlib.suppress(OSError):
            for raw in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, value = raw.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                    break
        line = f"CPU: {model} (bench_decode.cpu_line unavailable: {exc})"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{line}; {cpus} CPUs usable; load average {load}"


def version(lib: str) -> str:
    try:
        return importlib.metadata.version(DISTRIBUTIONS[lib])
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_library(lib: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", lib, "--result", str(out),
                "--vocab-size", str(args.vocab_size), "--fields", str(args.fields), "--runs", str(args.runs),
                "--walks", str(args.walks), "--seed", str(args.seed), "--compile-threads", str(args.compile_threads)]
        t = time.perf_counter()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"library": lib, "error": f"timed out after {args.timeout:.0f} s"}
        if out.exists():
            res = json.loads(out.read_text())
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            res = {"library": lib, "error": f"worker exited {proc.returncode}: {' | '.join(tail)}"}
        res["worker_s"] = time.perf_counter() - t
        return res


def worker_main(lib: str, args: argparse.Namespace) -> int:
    res: dict[str, Any] = {"library": lib}
    try:
        run_worker(lib, args, res)
    except BaseException as exc:  # reported in the library's row
        res["error"] = f"{res.get('stage', 'start')}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    Path(args.result).write_text(json.dumps(res))
    return 0


def fmt(value: Any, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def table(results: list[dict[str, Any]]) -> str:
    cols = ("library", "version", "tokenizer setup ms", "compile cold ms (CPU ms)", "compile warm ms",
            "first mask µs", "mask mean µs", "mask p50 µs", "mask p99 µs", "masks per doc ms (first walk)",
            "advance p50 µs", "apply eager µs", "apply own µs", "peak RSS +MiB", "compiled MiB", "checks")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lib = r["library"]
        if "mask_p50_us" not in r:
            cells = [lib, version(lib), f"failed: {r.get('error') or '; '.join(r.get('failures', [])[:2])}"]
            cells += [fmt(r.get("setup_s"), ".0f", 1e3) if i == 0 else "-" for i in range(len(cols) - len(cells))]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [
            lib, version(lib), fmt(r.get("setup_s"), ".0f", 1e3),
            f"{fmt(r.get('cold_s'), '.1f', 1e3)} ({fmt(r.get('cold_cpu_s'), '.0f', 1e3)})",
            fmt(r.get("warm_s"), ".3f", 1e3), fmt(r.get("first_mask_us"), ".0f"),
            fmt(r.get("mask_mean_us")), fmt(r.get("mask_p50_us")), fmt(r.get("mask_p99_us")),
            f"{fmt(r.get('doc_ms'), '.2f')} ({fmt(r.get('first_walk_ms'), '.2f')})",
            fmt(r.get("advance_p50_us")), fmt(r.get("apply_eager_p50_us"), ".0f"), fmt(r.get("apply_own_p50_us"), ".0f"),
            fmt(r.get("rss_growth"), ".1f", 1 / 2**20), fmt(r.get("reported_bytes"), ".2f", 1 / 2**20),
            r.get("checks", "-") + (f" (error: {r['error']})" if "error" in r else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def new_schema_ms(r: dict[str, Any]) -> float:
    """A request whose schema was never compiled: cold compile + the first walk's masks."""
    return r["cold_s"] * 1e3 + r["first_walk_ms"]


def cached_ms(r: dict[str, Any]) -> float:
    """A request whose schema was compiled before: warm setup + a steady walk's masks."""
    return r["warm_s"] * 1e3 + r["doc_ms"]


def recommendation(results: list[dict[str, Any]]) -> str:
    ok = [r for r in results if "mask_p50_us" in r and not r.get("failures") and "error" not in r]
    left_out = [r for r in results if r not in ok]
    why = "; ".join(f"{r['library']} ({r.get('error') or r['failures'][0]})" for r in left_out
                    if r.get("error") or r.get("failures"))
    if not ok:
        return "No library completed the walk with every check passing, so there is no recommendation" + (f": {why}." if why else ".")
    by_new = sorted(ok, key=new_schema_ms)
    by_cached = sorted(ok, key=cached_ms)
    by_p99 = sorted(ok, key=lambda r: r["mask_p99_us"])
    best = by_new[0]
    names = ", ".join(r["library"] for r in ok)
    parts = [f"Among the libraries that passed every check ({names}):"]

    def versus(rs: list[dict[str, Any]], key: Callable[[dict[str, Any]], float], spec: str) -> str:
        head, rest = rs[0], rs[1:]
        if not rest:
            return f"{head['library']} {format(key(head), spec)} ms"
        return f"{head['library']} {format(key(head), spec)} ms, " + ", ".join(
            f"{r['library']} {format(key(r), spec)} ms ({key(r) / key(head):.1f}x)" for r in rest)

    parts.append(f"a request with a schema not yet compiled (cold compile + first walk of the {best['doc_tokens']}-token "
                 f"document) costs {versus(by_new, new_schema_ms, '.1f')};")
    parts.append(f"with the schema already compiled (warm setup + the walk's masks) {versus(by_cached, cached_ms, '.2f')};")
    parts.append("per mask p50/p99 " + ", ".join(
        f"{r['library']} {r['mask_p50_us']:.0f}/{r['mask_p99_us']:.0f} µs" for r in by_p99) + ".")
    pick = best
    if by_cached[0] is not best and cached_ms(best) > 2 * cached_ms(by_cached[0]) and new_schema_ms(by_cached[0]) < 2 * new_schema_ms(best):
        pick = by_cached[0]  # much cheaper per token and at most 2x dearer per new schema
    reason = ("cheapest both for new and for cached schemas" if pick is by_new[0] and pick is by_cached[0]
              else "cheapest for new schemas" if pick is best
              else "cheapest once schemas are cached and within 2x for new ones")
    tail = " and the lowest p99 mask time" if pick is by_p99[0] else ""
    parts.append(f"Recommendation: {pick['library']}, {reason}{tail}.")
    if why:
        parts.append(f"Left out: {why}.")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=None, help="tokens in the vocabulary, EOS included (128000)")
    ap.add_argument("--fields", type=int, default=30, help="properties of the schema (30)")
    ap.add_argument("--runs", type=int, default=None, help="compile runs, cold and warm (3)")
    ap.add_argument("--walks", type=int, default=None, help="timed document walks after the first (5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8000-token vocabulary, 1 compile run, 2 walks")
    ap.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated subset of " + ",".join(LIBRARIES))
    ap.add_argument("--compile-threads", type=int, default=min(8, os.cpu_count() or 1),
                    help="xgrammar GrammarCompiler max_threads (min(8, CPUs))")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per library (1800)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    def pick(value: Any, full: Any, fast: Any) -> Any:
        return value if value is not None else (fast if args.quick else full)

    args.vocab_size = pick(args.vocab_size, 128000, 8000)
    args.runs = max(1, pick(args.runs, 3, 1))
    args.walks = max(1, pick(args.walks, 5, 2))
    if args.worker:
        return worker_main(args.worker, args)
    libs = [x.strip() for x in args.libraries.split(",") if x.strip()]
    unknown = [x for x in libs if x not in BACKENDS]
    if unknown:
        ap.error(f"unknown libraries {unknown}; choose from {', '.join(LIBRARIES)}")

    print(cpu_line())
    print("versions: " + ", ".join(f"{lib} {version(lib)}" for lib in libs)
          + f"; python {sys.version.split()[0]}; torch {version_of('torch')}")
    results = []
    for lib in libs:
        print(f"running {lib} ...", file=sys.stderr, flush=True)
        sys.stdout.flush()
        results.append(run_library(lib, args))
    r0 = next((r for r in results if "doc_tokens" in r), None)
    if r0:
        print(f"vocabulary: {r0['vocab_size']} tokens ({r0['non_utf8_tokens']} not valid UTF-8 on their own), "
              f"EOS id {r0['vocab_size'] - 1}; schema: {args.fields} required fields; document: "
              f"{r0['doc_bytes']} bytes, {r0['doc_tokens']} tokens, {r0['doc_tokens'] + 1} masks per walk; "
              f"{args.runs} compile runs, {args.walks} timed walks + 1 first walk")
    print()
    print(table(results))
    print()
    for r in results:
        lib = r["library"]
        if "separators" in r:
            print(f"- {lib} accepts {r['separators']}")
        for note in r.get("notes", []):
            print(f"- {lib}: {note}")
        if "raw_p99_us" in r:
            print(f"- {lib}: pooled over all timed steps (no per-step median): p99 {r['raw_p99_us']:.1f} µs, "
                  f"max {r['raw_max_us']:.0f} µs, median document {r['raw_doc_ms']:.2f} ms; import {r['import_s'] * 1e3:.0f} ms; "
                  f"first cold compile {r['cold_first_s'] * 1e3:.1f} ms")
        if "single_token_masks" in r:
            multi = f"; mask p50 over the other steps {r['multi_p50_us']:.1f} µs" if "multi_p50_us" in r else ""
            print(f"- {lib}: masks with a single allowed token: {r['single_token_masks']}/{r['masks_per_walk']}, "
                  f"median allowed tokens per mask {r['median_allowed']:.0f}{multi}")
        if "alt_p50_us" in r:
            print(f"- {lib}: Index.get_allowed_tokens turned into a bool mask: p50 {r['alt_p50_us']:.1f} µs "
                  f"(vs {r['mask_p50_us']:.1f} µs for the bitmask fill)")
        for f in r.get("failures", [])[:8]:
            print(f"- {lib} FAILED: {f}")
        if "error" in r:
            print(f"- {lib} ERROR: {r['error']}")
    print()
    print(recommendation(results))
    return 0


def version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
