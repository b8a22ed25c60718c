"""GGUF checkpoints (docs/design.md §20): files written from tiny transformers checkpoints the
way llama.cpp's converter writes them (``gguf_files.write_gguf``) load to the same model, the
same tokenizer and the same chat template, and a bad file is one clear CheckpointError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_files import write_gguf  # noqa: E402
from rtpcore import Engine, SamplingParams  # noqa: E402
from rtpcore.checkpoint import load_checkpoint, read_hf_config  # noqa: E402
from rtpcore.checkpoint.gguf import gguf_tokenizer, gguf_tokenizer_config, open_gguf  # noqa: E402
from rtpcore.engine.text.chat_template import ChatTemplate  # noqa: E402
from rtpcore.engine.text.tokenizer import Tokenizer  # noqa: E402
from rtpcore.errors import CheckpointError, MissingTensorsError, UnknownArchitectureError  # noqa: E402
from rtpcore.models.llama import LlamaPlugin  # noqa: E402
from test_llama import hf_greedy, make_checkpoint  # noqa: E402
from tokenizer_files import KIND_CORPUS, byte_bpe, kind_tokenizer  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEMPLATE = "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}<|eot_id|>{% endfor %}"
PROMPTS = [[5, 9, 33, 7, 81], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
TEXTS = [
    *KIND_CORPUS[:5],
    "Hello, world!  How   are you?\n\n\tIndented\r\nline   ",
    "    leading and trailing spaces    ",
    "日本語のテキスト 😀🎉👍🏽 naïve café Ünïcödé ✓ “quotes”",
    "numbers 1234567 3.14159 and 'contractions' don't I'll WE'RE",
    f"{BOS}special tokens<|eot_id|> inside <|start_header_id|>user<|end_header_id|>",
    "",
]


def convert(tmp: Path, variant: str = "llama-gqa", file_type: str = "F32", **options: Any) -> tuple[Any, Path]:
    """A tiny transformers checkpoint of ``variant`` (vocab 420, the byte-level BPE's) and its GGUF."""
    hf = make_checkpoint(tmp / "st", variant, vocab_size=420)
    opts: dict[str, Any] = {"tokenizer": byte_bpe(), "bos": BOS, "eos": EOS, "chat_template": TEMPLATE, **options}
    return hf, write_gguf(tmp / "st", tmp / f"model-{file_type}.gguf", file_type=file_type, **opts)


def gguf_state_dict(path: Path, hf: Any) -> dict[str, torch.Tensor]:
    """The GGUF's tensors under transformers' names, through the Llama plugin's tensor map."""
    config = read_hf_config(path)
    names = LlamaPlugin.gguf_tensor_names(open_gguf(path), config)
    wanted = [n for n in hf.state_dict() if n != "lm_head.weight" or not config["tie_word_embeddings"]]
    weights = load_checkpoint(path, wanted, tensor_names=names)
    return dict(weights)


# -- the model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied", "qwen2-bias", "mistral-window"])
def test_f32_gguf_gives_the_tokens_of_its_safetensors_checkpoint_and_transformers(tmp_path: Path, variant: str) -> None:
    """An F32 GGUF converted from a checkpoint (Q/K rows permuted for llama) generates exactly
    the greedy tokens of that safetensors checkpoint through the engine, and of transformers."""
    hf, path = convert(tmp_path, variant)
    with Engine.from_pretrained(tmp_path / "st") as engine:
        want = engine.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    with Engine.from_pretrained(path) as engine:
        assert engine.model_type == "llama"
        got = engine.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    assert got == want
    assert got[0] == hf_greedy(hf, PROMPTS[0], 24)
    # the loaded tensors are the original ones, bit for bit
    original = hf.state_dict()
    for name, tensor in gguf_state_dict(path, hf).items():
        assert torch.equal(tensor, original[name]), name


def test_gguf_config_is_the_checkpoints_config(tmp_path: Path) -> None:
    """The config.json read from the metadata has the original's hyper-parameters, ties the
    embeddings when output.weight is absent and takes BOS/EOS from tokenizer.ggml.*."""
    _, path = convert(tmp_path, "llama-tied")
    hf = read_hf_config(path)
    original = json.loads((tmp_path / "st" / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size", "head_dim"):
        assert hf[key] == original[key], key
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["tie_word_embeddings"] is True
    assert hf["bos_token_id"] == byte_bpe().token_to_id(BOS) and hf["eos_token_id"] == byte_bpe().token_to_id(EOS)
    assert hf["torch_dtype"] == "float32"


# Each weight is off by at most this fraction of the largest |weight| of its block of 32 (one
# quantization step: Q8_0 amax/127, Q5_1 (max-min)/31, Q5_0 amax/16, Q4_0 amax/8; F16 and BF16
# round to 11 and 8 significant bits), give or take the rounding of the block's f16 scale (times q <= 16).
WEIGHT_STEP = {"F16": 2**-11, "BF16": 2**-8, "Q8_0": 1 / 127, "Q5_1": 2 / 31, "Q5_0": 1 / 16, "Q4_0": 1 / 8}
# Bounds on |logit - original logit| for the tiny random model (logits within about +-4), F16,
# BF16 and Q8_0 files: their models stay close to the original.
LOGIT_TOLERANCE = {"F16": 0.02, "BF16": 0.1, "Q8_0": 0.35}


@pytest.mark.parametrize("file_type", ["F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_0"])
def test_quantized_gguf_loads_close_and_the_engine_runs_it_exactly(tmp_path: Path, file_type: str) -> None:
    """F16/BF16 and quantized files load (dequantized) to weights within one quantization
    step of the original's (WEIGHT_STEP), F16/BF16/Q8_0 to logits within LOGIT_TOLERANCE; the
    engine's greedy tokens on the file are transformers' on the same dequantized weights, exactly."""
    hf, path = convert(tmp_path, "llama-gqa", file_type)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    loaded = gguf_state_dict(path, hf)
    for name, w in loaded.items():
        if w.dim() == 2:  # 1-D tensors stay F32
            blocks = original[name].reshape(w.shape[0], -1, 32)
            bound = WEIGHT_STEP[file_type] * (1 + 2**-6) * blocks.abs().amax(dim=-1, keepdim=True) + 1e-7  # f16 scales
            assert ((w.float().reshape(blocks.shape) - blocks).abs() <= bound).all(), name
    prompt = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        want = hf(prompt).logits
        hf.load_state_dict({k: v.float() for k, v in loaded.items()}, strict=False)
        got = hf(prompt).logits
    if file_type in LOGIT_TOLERANCE:
        assert (got - want).abs().max().item() <= LOGIT_TOLERANCE[file_type]
    with Engine.from_pretrained(path, quantization="none") as engine:  # dequantized (tests/test_gguf_method.py: blocks)
        tokens = engine.generate(PROMPTS[:1], max_new_tokens=16, stop_token_ids=[])
    assert tokens[0] == hf_greedy(hf, PROMPTS[0], 16)


def test_quantized_load_warns_with_the_memory_it_costs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Dequantizing Q8_0 at load is logged once, naming the type and the memory."""
    hf, path = convert(tmp_path, "llama-gqa", "Q8_0")
    with caplog.at_level("WARNING", logger="rtpcore.checkpoint.gguf.weights"):
        gguf_state_dict(path, hf)
    [record] = [r for r in caplog.records if "dequantized" in r.getMessage()]
    assert "Q8_0" in record.getMessage() and "MB in memory" in record.getMessage()


def test_only_the_wanted_tensors_are_read(tmp_path: Path) -> None:
    """load_checkpoint on a GGUF file reads the tensors its patterns name and nothing else."""
    _, path = convert(tmp_path)
    names = LlamaPlugin.gguf_tensor_names(open_gguf(path), read_hf_config(path))
    weights = load_checkpoint(path, ["model.layers.{layer}.mlp.up_proj.weight"], {"layer": range(2)},
                              tensor_names=names)
    assert sorted(weights) == ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert weights.stats.tensor_bytes_read == 2 * 128 * 64 * 4


# -- split files and folders ---------------------------------------------------------------------


def test_split_set_loads_from_any_part_or_its_folder(tmp_path: Path) -> None:
    """A set written in parts opens from any part's name or the folder, as one model."""
    hf, _ = convert(tmp_path / "whole")
    split = tmp_path / "split"
    split.mkdir()
    first = write_gguf(tmp_path / "whole" / "st", split / "model.gguf", tokenizer=byte_bpe(), bos=BOS, eos=EOS,
                       split_max_tensors=6)
    parts = sorted(split.glob("*.gguf"))
    assert len(parts) == 4 and first.name == "model-00001-of-00004.gguf"
    want = hf_greedy(hf, PROMPTS[0], 12)
    for where in (parts[0], parts[2], split):
        assert len(open_gguf(where).tensors) == 21
        with Engine.from_pretrained(where) as engine:
            assert engine.generate(PROMPTS[:1], max_new_tokens=12, stop_token_ids=[])[0] == want
    parts[1].unlink()
    with pytest.raises(CheckpointError) as excinfo:
        open_gguf(parts[0])
    assert excinfo.value.key == parts[1].name and parts[1].name in str(excinfo.value)


def test_folder_with_two_models_asks_for_the_file(tmp_path: Path) -> None:
    _, path = convert(tmp_path)
    (tmp_path / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match="2 GGUF models"):
        open_gguf(tmp_path)


# -- tokenizer and chat template -----------------------------------------------------------------


def _qwen2_style_bpe() -> Any:
    """A byte-level BPE with Qwen2's pre-tokenizer (regex split, then bytes), trained here."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from rtpcore.checkpoint.gguf.vocab import _QWEN2_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS, "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    tok.train_from_iterator(KIND_CORPUS * 2, trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


@pytest.mark.parametrize("kind", ["gpt2", "qwen2", "sentencepiece"])
def test_tokenizer_round_trips_equal_the_original(tmp_path: Path, kind: str) -> None:
    """The tokenizer rebuilt from tokenizer.ggml.* encodes and decodes every text (unicode,
    whitespace runs, special tokens) exactly as the tokenizers object it was written from."""
    make_checkpoint(tmp_path / "st", "llama-gqa", vocab_size=600)
    if kind == "sentencepiece":  # SentencePiece BPE as transformers converts Llama 2's, with byte fallback
        original = kind_tokenizer("sentencepiece")
        path = write_gguf(tmp_path / "st", tmp_path / "m.gguf", tokenizer=original, vocab="llama", bos="<s>",
                          eos="</s>", add_bos=False)
        texts = [t.replace(BOS, "<s>").replace("<|start_header_id|>", "<|im_start|>") for t in TEXTS]
    else:
        original = byte_bpe() if kind == "gpt2" else _qwen2_style_bpe()
        path = write_gguf(tmp_path / "st", tmp_path / "m.gguf", tokenizer=original, pre="gpt-2" if kind == "gpt2"
                          else "qwen2", bos=BOS, eos=EOS)
        texts = TEXTS
    rebuilt = Tokenizer.from_pretrained(path)
    for text in texts:
        ids = original.encode(text, add_special_tokens=False).ids
        assert rebuilt.encode(text, add_special_tokens=False) == ids, text
        for skip in (True, False):
            assert rebuilt.decode(ids, skip_special_tokens=skip) == original.decode(ids, skip_special_tokens=skip)
    assert rebuilt.vocab_size == original.get_vocab_size()


def test_bos_is_added_as_the_file_says(tmp_path: Path) -> None:
    """tokenizer.ggml.add_bos_token decides whether encode adds BOS; the named special
    tokens come from the BOS/EOS ids."""
    _, path = convert(tmp_path, add_bos=True)
    tok = Tokenizer.from_pretrained(path)
    bos = byte_bpe().token_to_id(BOS)
    assert tok.encode("Hello")[0] == bos and tok.encode("Hello", add_special_tokens=False)[0] != bos
    assert (tok.bos_token_id, tok.eos_token_id) == (bos, byte_bpe().token_to_id(EOS))


def test_chat_template_comes_from_the_file(tmp_path: Path) -> None:
    """tokenizer.chat_template is the checkpoint's chat template, with the file's special tokens;
    the engine's chat renders with it."""
    _, path = convert(tmp_path, add_bos=False)
    config = gguf_tokenizer_config(open_gguf(path))
    assert config["chat_template"] == TEMPLATE and config["bos_token"] == BOS
    text = ChatTemplate.from_pretrained(path).render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert text == f"{BOS}<|start_header_id|>user<|end_header_id|>Hi<|eot_id|>"
    with Engine.from_pretrained(path) as engine:
        out = engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))
    assert list(out[0].prompt_token_ids) == byte_bpe().encode(text, add_special_tokens=False).ids


# -- bad files -----------------------------------------------------------------------------------


def test_truncated_file_names_the_file_and_the_tensor(tmp_path: Path) -> None:
    _, path = convert(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError) as excinfo:
        open_gguf(path)
    assert str(path) in str(excinfo.value) and "truncated" in str(excinfo.value)
    assert excinfo.value.key is not None and excinfo.value.key in str(excinfo.value)
    path.write_bytes(data[:3000])  # inside the metadata
    with pytest.raises(CheckpointError, match="truncated") as excinfo:
        Engine.from_pretrained(path)
    assert excinfo.value.path == path


def test_unknown_tensor_type_names_the_tensor(tmp_path: Path) -> None:
    _, path = convert(tmp_path)
    reader = gguf.GGUFReader(path)
    field = next(t.field for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    offset = field.offset + sum(int(p.nbytes) for p in field.parts[:4])  # name, n_dims, dims: then the type
    del reader
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = (777).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as excinfo:
        open_gguf(path)
    assert excinfo.value.key == "blk.1.ffn_down.weight"
    assert str(path) in str(excinfo.value) and "777" in str(excinfo.value)


def test_missing_metadata_key_names_the_key(tmp_path: Path) -> None:
    _, path = convert(tmp_path, skip=("llama.block_count",))
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(path)
    assert excinfo.value.key == "llama.block_count" and str(path) in str(excinfo.value)


def test_missing_tensor_names_the_tensor(tmp_path: Path) -> None:
    _, path = convert(tmp_path, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(MissingTensorsError) as excinfo:
        Engine.from_pretrained(path)
    assert "blk.1.ffn_up.weight" in str(excinfo.value) and str(path) in str(excinfo.value)
    assert excinfo.value.missing == ("model.layers.1.mlp.up_proj.weight",)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        open_gguf(path)


# -- plugins -------------------------------------------------------------------------------------


def test_unserved_architecture_lists_the_served_ones() -> None:
    from rtpcore.plugins.loading import load_plugins

    registry = load_plugins()
    with pytest.raises(UnknownArchitectureError) as excinfo:
        registry.gguf_model_type("falcon")
    assert "'falcon'" in str(excinfo.value) and "llama, mistral, qwen2" in str(excinfo.value)
    assert registry.gguf_model_type("qwen2") == "llama"


def test_tokenizer_object_is_a_tokenizers_tokenizer(tmp_path: Path) -> None:
    """The rebuilt tokenizer is a plain ``tokenizers.Tokenizer`` (what grammars and serving use)."""
    from tokenizers import Tokenizer as Backend

    _, path = convert(tmp_path)
    assert isinstance(gguf_tokenizer(open_gguf(path)), Backend)
    assert np.array_equal(np.array(open_gguf(path).tensor("token_embd.weight").shape), [420, 64])


def test_the_private_reader_hooks_still_exist() -> None:
    """rtpcore.checkpoint.gguf.reader overrides GGUFReader._build_tensors (private) to check each
    tensor info before the package builds it, and _get and _get_field_parts (private) to read the
    header without a memmap slice per value: a gguf release that renames them or changes their
    arguments must fail here, not silently skip the check or fall back to the slow reading."""
    import inspect

    from gguf import GGUFReader

    assert list(inspect.signature(GGUFReader._build_tensors).parameters) == ["self", "start_offs", "fields"]
    assert list(inspect.signature(GGUFReader._get).parameters) == ["self", "offset", "dtype", "count",
                                                                   "override_order"]
    assert list(inspect.signature(GGUFReader._get_field_parts).parameters) == ["self", "orig_offs", "raw_type"]


@pytest.mark.parametrize("file_type", ["F32", "Q8_0"])
def test_the_header_reads_as_the_packages_reader_reads_it(tmp_path: Path, file_type: str) -> None:
    """rtpcore's reading of the header (rtpcore.checkpoint.gguf.reader: GGUFReader with a faster
    _get and _get_field_parts) gives every field the package's own GGUFReader gives: the same
    parts, data indices, types and contents; the same tensors."""
    from gguf import GGUFReader

    from rtpcore.checkpoint.gguf.reader import _reader

    _, path = convert(tmp_path, "llama-tied", file_type, extra={"test.empty": ("array", [])})
    ours, theirs = _reader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), key
        assert [p.tobytes() for p in mine.parts] == [p.tobytes() for p in field.parts], key
        assert mine.contents() == field.contents(), key
    assert [(t.name, t.data_offset, t.data.tobytes()) for t in ours.tensors] == \
        [(t.name, t.data_offset, t.data.tobytes()) for t in theirs.tensors]
