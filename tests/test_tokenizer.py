"""rtpcore.engine.text.tokenizer: a checkpoint's tokenizer.json gives the ids and text transformers'
AutoTokenizer gives on the same folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rtpcore.engine.text.tokenizer import Tokenizer, special_tokens
from rtpcore.errors import CheckpointError, ConfigFieldError
from tokenizer_files import write_tokenizer

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "日本語のテキスト 😀🎉 naïve",
    "<|begin_of_text|>already there<|eot_id|> and after",
    "  leading spaces\n\nand newlines\t",
    "",
]
FAST = {"tokenizer_class": "PreTrainedTokenizerFast"}
ADDED_BOS = {"content": "<|begin_of_text|>", "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False, "special": True, "__type": "AddedToken"}

CONFIGS: dict[str, tuple[dict[str, Any] | None, bool]] = {
    # name: (tokenizer_config.json or None, tokenizer.json's post-processor adds BOS)
    "llama3: tokenizer.json adds BOS": (
        {**FAST, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, True),
    "add_bos_token is ignored: tokenizer.json decides": (
        {**FAST, "add_bos_token": True, "add_eos_token": False, "bos_token": ADDED_BOS,
         "eos_token": {"__type": "AddedToken", "content": "<|end_of_text|>", "special": True}}, False),
    "add_bos_token false is ignored too": (
        {**FAST, "add_bos_token": False, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, True),
    "add_eos_token is ignored": (
        {**FAST, "add_bos_token": True, "add_eos_token": True, "bos_token": "<|begin_of_text|>",
         "eos_token": "<|end_of_text|>"}, False),
    "a special token tokenizer.json lacks": (
        {**FAST, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|pad|>"}, False),
    "no tokenizer_config.json": (None, False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_encode_and_decode_equal_transformers_autotokenizer(tmp_path: Path, name: str) -> None:
    """encode (with and without special tokens) and decode (skipping special tokens or not)
    agree with AutoTokenizer on the same checkpoint folder, special-token ids included."""
    transformers = pytest.importorskip("transformers")
    config, bos_processor = CONFIGS[name]
    write_tokenizer(tmp_path, config, bos_processor=bos_processor)
    ours = Tokenizer.from_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    texts = [*TEXTS, "<|pad|> padded"]
    for text in texts:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == theirs.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.special_tokens == theirs.special_tokens_map
    assert ours.special_ids == frozenset(theirs.all_special_ids) | {
        i for i, t in theirs.added_tokens_decoder.items() if t.special
    }
    assert ours.vocab_size == len(theirs)


def test_added_tokens_decoder_of_tokenizer_config_is_honoured(tmp_path: Path) -> None:
    """A token tokenizer_config.json declares in added_tokens_decoder but tokenizer.json lacks
    is added (special or not) as transformers adds it."""
    transformers = pytest.importorskip("transformers")
    config = {**FAST, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "added_tokens_decoder": {
        "420": {"content": "<tool_call>", "special": False, "normalized": False, "lstrip": False, "rstrip": False, "single_word": False},
        "421": {"content": "<|im_end|>", "special": True, "normalized": False, "lstrip": False, "rstrip": False, "single_word": False},
    }}
    write_tokenizer(tmp_path, config)
    ours = Tokenizer.from_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "<tool_call>call<|im_end|> done"
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.token_to_id("<tool_call>") == 420 and ours.token_to_id("<|im_end|>") == 421
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "<tool_call>call done"


def test_special_tokens_accepts_strings_and_added_token_dicts() -> None:
    """Named special tokens come out as strings; null ones are left out."""
    got = special_tokens({"bos_token": ADDED_BOS, "eos_token": "</s>", "pad_token": None, "other": "x"})
    assert got == {"bos_token": "<|begin_of_text|>", "eos_token": "</s>"}


def test_a_special_token_of_the_wrong_type_is_a_config_field_error() -> None:
    """A special token that is neither a string nor {'content': str} names the field."""
    with pytest.raises(ConfigFieldError) as excinfo:
        special_tokens({"eos_token": 7})
    assert excinfo.value.field == "eos_token" and excinfo.value.file == "tokenizer_config.json"
    assert "'eos_token'" in str(excinfo.value)


def test_a_checkpoint_without_tokenizer_json_is_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    """No tokenizer.json: CheckpointError whose message and .path name the file."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as excinfo:
        Tokenizer.from_pretrained(tmp_path)
    assert excinfo.value.path == tmp_path / "tokenizer.json"
    assert "tokenizer.json" in str(excinfo.value) and str(tmp_path) in str(excinfo.value)


@pytest.mark.parametrize(("file", "text", "needle"), [
    ("tokenizer.json", "{not json", "tokenizer.json"),
    ("tokenizer_config.json", "{not json", "tokenizer_config.json"),
    ("tokenizer_config.json", "[1, 2]", "JSON object"),
])
def test_unreadable_tokenizer_files_are_checkpoint_errors(tmp_path: Path, file: str, text: str, needle: str) -> None:
    """A malformed tokenizer.json or tokenizer_config.json is a CheckpointError naming the file."""
    write_tokenizer(tmp_path)
    (tmp_path / file).write_text(text)
    with pytest.raises(CheckpointError) as excinfo:
        Tokenizer.from_pretrained(tmp_path)
    assert needle in str(excinfo.value) and excinfo.value.path == tmp_path / file


def test_importing_the_module_loads_no_tokenizers(tmp_path: Path) -> None:
    """rtpcore.engine.text.tokenizer imports `tokenizers` only when a tokenizer is loaded."""
    import subprocess
    import sys

    code = "import sys, rtpcore.engine.text.tokenizer; print('tokenizers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


MEMORY_PROBE = """
import sys, threading
from pathlib import Path
from rtpcore.engine.text.tokenizer import Tokenizer

def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")

path = Path(sys.argv[1])
if sys.argv[2] == "rtpcore":
    tok = Tokenizer.from_pretrained(path)
    encode = lambda text: tok.encode(text, add_special_tokens=False)
else:
    from tokenizers import Tokenizer as Raw
    raw = Raw.from_file(str(path / "tokenizer.json"))
    encode = lambda text: raw.encode(text, add_special_tokens=False).ids
words = "Paris Tokyo capital France Japan hello world fine thank you".split()

def work(t: int) -> None:  # 8,000 distinct prompts of ~200 characters, each one word to the model
    for i in range(8000):  # (tokenizers caches words of up to 256 characters, 10,000 of them)
        encode(" ".join(words[(i * 7 + j * t) % len(words)] + str(i * 100 + t * 7 + j) for j in range(18)))

encode("warm up")
before = rss()
threads = [threading.Thread(target=work, args=(0,))]  # a worker thread, as the server's
for th in threads:
    th.start()
for th in threads:
    th.join()
print(rss() - before)
"""


def test_encoding_new_text_on_many_threads_holds_no_word_cache(tmp_path: Path) -> None:
    """A loaded Tokenizer keeps no per-thread word cache (docs/design.md §22: the server encodes on
    the event loop's worker threads, and `tokenizers` caches up to 10,000 words). On a tokenizer
    that keeps a prompt one word, 8,000 new prompts grow a fresh process's memory by tens of MB
    through `tokenizers` with its cache (57 MB here), and by a fraction of that through rtpcore's
    Tokenizer. This fails loudly if `tokenizers` drops `Model._resize_cache` or stops
    needing it."""
    import json
    import subprocess
    import sys

    write_tokenizer(tmp_path, FAST)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["use_regex"] = False  # the text is not split: each prompt is one word
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    from tokenizers import Tokenizer as Raw

    assert hasattr(Raw.from_file(str(tmp_path / "tokenizer.json")).model, "_resize_cache")
    grown: dict[str, int] = {}
    for mode in ("tokenizers", "rtpcore", "tokenizers", "rtpcore"):
        # Each mode twice, the larger growth kept: on a loaded machine one tokenizers probe in a few
        # showed no cache growth at all. The control must show the cache once; every rtpcore run
        # must stay small.
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path), mode], capture_output=True,
                             text=True, check=True)
        grown[mode] = max(grown.get(mode, 0), int(out.stdout.strip()))
    assert grown["tokenizers"] > 24 << 20, f"tokenizers' cache no longer grows ({grown}): revisit _no_word_cache"
    assert grown["rtpcore"] < grown["tokenizers"] / 8, grown


def test_encode_releases_the_gil_while_it_works(tmp_path: Path) -> None:
    """Tokenizer.encode goes through the `tokenizers` batch encoder, which releases the GIL
    (docs/design.md §17: the server encodes in a worker thread, and its event loop must keep
    running). With the interpreter's switch interval at 60 s no thread is made to give the GIL
    up between bytecodes: the main thread runs while the worker is inside encode only when
    encode releases the GIL (a single `tokenizers` encode does not)."""
    import sys
    import threading

    tok = Tokenizer.from_pretrained(write_tokenizer(tmp_path, FAST))
    text = "The capital of France is Paris. Hello, world! " * 20_000
    state = {"inside": False, "seen_inside": False}
    started = threading.Event()

    def work() -> None:
        state["inside"] = True
        started.set()
        tok.encode(text)
        state["inside"] = False

    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        state["seen_inside"] = bool(state["inside"])
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert state["seen_inside"], "the main thread ran only once encode was over: encode held the GIL"
    raw = tok._backend.encode(text).ids  # the batch encoder gives a single encode's ids
    assert tok.encode(text) == list(raw)


def _bpe_json(**parts: Any) -> Any:
    """The trained byte-level BPE with some parts of its tokenizer.json replaced."""
    import json

    from tokenizers import Tokenizer as Raw

    from tokenizer_files import byte_bpe

    spec = json.loads(byte_bpe().to_str())
    for key, value in parts.items():
        if key == "model":
            spec["model"].update(value)
        else:
            spec[key] = value
    return Raw.from_str(json.dumps(spec))


LONGEST_CASES: dict[str, tuple[dict[str, Any], int | None]] = {
    # name: (tokenizer.json parts replaced, the bound as a multiple of the longest entry, None: no bound)
    "byte-level BPE": ({}, 1),
    "NFC composes up to four code points into one": ({"normalizer": {"type": "NFC"}}, 4),
    "a normalizer that strips text": ({"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}}, None),
    "a pre-tokenizer that drops whitespace": ({"pre_tokenizer": {"type": "WhitespaceSplit"}}, None),
    "a BPE with no unknown token and an incomplete alphabet": ({"pre_tokenizer": None}, None),
    "a fused unknown token": ({"pre_tokenizer": None, "model": {"unk_token": "<|eot_id|>", "fuse_unk": True}}, None),
    "an unknown token per character": ({"pre_tokenizer": None, "model": {"unk_token": "<|eot_id|>"}}, 1),
}


@pytest.mark.parametrize("name", sorted(LONGEST_CASES))
def test_the_longest_token_in_characters_bounds_every_encoding_or_is_none(tmp_path: Path, name: str) -> None:
    """Tokenizer.max_chars_per_token (docs/design.md §17: a prompt longer than it times
    max_model_len is refused unencoded) is the longest vocabulary entry times what the
    normalizer can fold, or None where text can vanish or one token can cover any run of it;
    where it is a number, no text encodes to fewer tokens than its length divided by it."""
    parts, factor = LONGEST_CASES[name]
    raw = _bpe_json(**parts)
    tok = Tokenizer.from_pretrained(write_tokenizer(tmp_path, FAST, tokenizer=raw))
    longest = max(len(t) for t in raw.get_vocab(with_added_tokens=True))
    assert tok.max_chars_per_token == (None if factor is None else factor * longest)
    if tok.max_chars_per_token is not None:
        for text in [*TEXTS, "e\u0301\u0323" * 50, " " * 5000, "<|eot_id|>" * 40, "\u00e9" * 300]:
            ids = tok.encode(text, add_special_tokens=False)
            assert len(text) <= len(ids) * tok.max_chars_per_token, text[:40]


def test_an_added_token_that_swallows_blanks_gives_no_bound(tmp_path: Path) -> None:
    from tokenizers import AddedToken

    raw = _bpe_json()
    raw.add_tokens([AddedToken("<tool>", rstrip=True)])
    tok = Tokenizer.from_pretrained(write_tokenizer(tmp_path, FAST, tokenizer=raw))
    assert tok.max_chars_per_token is None


def test_a_text_certain_to_exceed_max_model_len_is_refused_before_it_is_encoded(tmp_path: Path) -> None:
    """TextSide refuses a prompt -- text, or a rendered conversation -- whose characters over the
    longest token already exceed max_model_len, with an InvalidRequestError naming the field
    (code context_length_exceeded), without encoding it; a text at the bound is encoded."""
    from rtpcore.engine.text.prompts import TextSide
    from rtpcore.errors import InvalidRequestError

    config = {**FAST, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    side = TextSide(write_tokenizer(tmp_path, config), eos_token_ids=(), max_model_len=64)
    tok = side.tokenizer
    assert tok is not None and tok.max_chars_per_token is not None
    encoded: list[int] = []
    real = tok._backend

    class Counting:
        def __getattr__(self, name: str) -> Any:
            if name.startswith("encode"):
                encoded.append(1)
            return getattr(real, name)

    tok._backend = Counting()
    bound = 64 * tok.max_chars_per_token
    with pytest.raises(InvalidRequestError) as info:
        side.encode(["a" * (bound + 1)], field="prompt")
    assert (info.value.field, info.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(InvalidRequestError) as info:
        side.render_conversation([{"role": "user", "content": "a" * (bound + 1)}])
    assert (info.value.field, info.value.code) == ("messages", "context_length_exceeded")
    assert encoded == []
    side.encode(["a" * bound])
    assert side.render_conversation([{"role": "user", "content": "a" * (bound + 1)}], check_length=False)
    assert len(encoded) == 2
