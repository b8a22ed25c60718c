"""Loading a model's tensors from real safetensors checkpoints: what is read, what is not."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rtpcore.checkpoint import LoadedWeights, WeightSelection, load_checkpoint, read_hf_config
from rtpcore.checkpoint.index import INDEX_NAME
from rtpcore.errors import CheckpointError, MissingTensorsError

LLAMA_PATTERNS = [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(
        f"model.layers.{{layer}}.{part}.weight"
        for part in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ),
]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama saved by transformers in several shards with an index, and its state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="20KB")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return path, state


@pytest.fixture
def llama_copy(hf_llama: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    """A private copy of the sharded checkpoint that a test may damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_llama[0], dst)
    return dst


def _index_map(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX_NAME).read_text())["weight_map"]


def test_sharded_transformers_checkpoint_loads_bit_exact(hf_llama):
    """Every Llama tensor saved by transformers comes back identical, from several shards."""
    path, state = hf_llama
    weights = load_checkpoint(path, LLAMA_PATTERNS, {"layer": range(2)})
    assert isinstance(weights, LoadedWeights)
    assert weights.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(weights[name], tensor), name
    assert weights.stats.shards_total == len(set(_index_map(path).values())) > 2
    assert len(weights.stats.files_opened) == weights.stats.shards_total
    assert weights.stats.tensor_bytes_read == sum(
        t.numel() * t.element_size() for t in state.values()
    )


def test_dtype_converts_floating_point_tensors(hf_llama):
    """``dtype`` (a torch dtype or its name) converts every floating tensor."""
    path, state = hf_llama
    for dtype in (torch.bfloat16, "bfloat16"):
        weights = load_checkpoint(path, ["model.norm.weight"], {}, dtype=dtype)
        assert weights["model.norm.weight"].dtype == torch.bfloat16
        assert torch.equal(weights["model.norm.weight"], state["model.norm.weight"].bfloat16())
    with pytest.raises(ValueError, match="not a torch dtype"):
        load_checkpoint(path, ["model.norm.weight"], {}, dtype="float33")


def test_dtypes_keep_matching_tensors_in_their_own_dtype(hf_llama):
    """``dtypes`` overrides ``dtype`` for the tensors its patterns match, and only for them."""
    path, state = hf_llama
    weights = load_checkpoint(
        path,
        ["model.layers.{layer}.input_layernorm.weight", "model.norm.weight"],
        {"layer": range(2)},
        dtype="bfloat16",
        dtypes={"model.layers.{layer}.input_layernorm.weight": "float32"},
    )
    for layer in range(2):
        name = f"model.layers.{layer}.input_layernorm.weight"
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], state[name])
    assert weights["model.norm.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float33"):
        load_checkpoint(path, ["model.norm.weight"], {}, dtypes={"model.norm.weight": "float33"})


def test_integer_and_fp8_tensors_keep_their_dtype(tmp_path):
    """Quantized payloads (int8, fp8) are not converted; float16 is."""
    save_file(
        {
            "q": torch.arange(6, dtype=torch.int8),
            "f8": torch.ones(4).to(torch.float8_e4m3fn),
            "h": torch.ones(2, dtype=torch.float16),
        },
        tmp_path / "model.safetensors",
    )
    w = load_checkpoint(tmp_path, ["q", "f8", "h"], {}, dtype=torch.float32)
    assert (w["q"].dtype, w["f8"].dtype, w["h"].dtype) == (
        torch.int8,
        torch.float8_e4m3fn,
        torch.float32,
    )


def test_every_dtype_and_odd_shape_reads_like_safetensors(tmp_path):
    """Every supported dtype, a scalar and an empty tensor come back byte-identical to
    safetensors' own reader, both from owned reads and from lazy mapped views."""
    from safetensors.torch import load_file

    from rtpcore.checkpoint.index import DTYPES

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for code, (_, name) in DTYPES.items():
        dtype = getattr(torch, name)
        raw = torch.randint(
            0, 255, (3, 5 * torch.empty((), dtype=dtype).element_size()), generator=gen
        )
        tensors[f"t.{code}"] = raw.to(torch.uint8).view(dtype)
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 3)
    save_file(tensors, tmp_path / "model.safetensors")
    theirs = load_file(tmp_path / "model.safetensors")
    for lazy in (False, True):
        ours = load_checkpoint(tmp_path, list(tensors), {}, lazy=lazy)
        for name, t in theirs.items():
            assert (ours[name].dtype, ours[name].shape) == (t.dtype, t.shape), name
            assert torch.equal(
                ours[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
            ), name


def test_draft_model_opens_only_its_shard_and_never_touches_garbage_shards(llama_copy):
    """A model needing layer 1 only opens the shard holding it; every other shard is
    replaced by garbage bytes or a FIFO, loading still succeeds and the stats show them unopened."""
    wmap = _index_map(llama_copy)
    needed_file = wmap["model.layers.1.mlp.down_proj.weight"]
    others = sorted(set(wmap.values()) - {needed_file})
    assert others
    for name in others[1:]:
        (llama_copy / name).write_bytes(b"\xff" * 64 + b"not a safetensors file")
    (llama_copy / others[0]).unlink()
    os.mkfifo(llama_copy / others[0])  # reading it would block forever (or be refused)
    w = load_checkpoint(llama_copy, ["model.layers.1.mlp.down_proj.weight"], {})
    assert list(w) == ["model.layers.1.mlp.down_proj.weight"]
    assert w.stats.files_opened == (needed_file,)
    assert w.stats.headers_read == (needed_file,)
    assert w.stats.shards_total == len(others) + 1


def test_garbage_in_a_needed_shard_is_caught(llama_copy):
    """The control for the pruning test: the same garbage in a needed shard is an error naming it."""
    needed_file = _index_map(llama_copy)["model.norm.weight"]
    (llama_copy / needed_file).write_bytes(b"\xff" * 64 + b"not a safetensors file")
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(llama_copy, ["model.norm.weight"], {})
    assert needed_file in str(excinfo.value)
    assert excinfo.value.path == llama_copy / needed_file


def test_without_index_headers_are_read_but_only_needed_files_opened(tmp_path):
    """Without an index every header is read (headers only); tensor data only from needed files."""
    save_file({"model.layers.0.w": torch.ones(4)}, tmp_path / "a.safetensors")
    save_file({"mtp.head.weight": torch.zeros(1000, 100)}, tmp_path / "b.safetensors")
    w = load_checkpoint(tmp_path, ["model.layers.{layer}.w"], {"layer": range(1)})
    assert w.stats.files_opened == ("a.safetensors",)
    assert w.stats.headers_read == ("a.safetensors", "b.safetensors")
    assert w.stats.tensor_bytes_read == 16
    assert w.stats.header_bytes_read < 400  # the 400 kB tensor of b was never read
    assert w.stats.bytes_read == w.stats.header_bytes_read + 16


def test_single_file_checkpoint_by_directory_or_file(tmp_path):
    """A directory with one model.safetensors and the file path itself both work."""
    save_file({"x": torch.arange(3.0)}, tmp_path / "model.safetensors")
    for p in (tmp_path, tmp_path / "model.safetensors"):
        assert torch.equal(load_checkpoint(p, ["x"], {})["x"], torch.arange(3.0))


def test_symlinked_shards_as_in_the_hub_cache(hf_llama, tmp_path):
    """Shards that are symlinks to blobs (the Hugging Face cache layout) load like files."""
    path, state = hf_llama
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(path, blobs)
    snap.mkdir()
    for f in blobs.iterdir():
        (snap / f.name).symlink_to(f)
    w = load_checkpoint(snap, ["model.norm.weight"], {})
    assert torch.equal(w["model.norm.weight"], state["model.norm.weight"])


def test_index_file_path_is_accepted(hf_llama):
    """The path of model.safetensors.index.json itself works like its directory."""
    path, state = hf_llama
    w = load_checkpoint(path / INDEX_NAME, ["model.norm.weight"], {})
    assert torch.equal(w["model.norm.weight"], state["model.norm.weight"])
    assert w.stats.files_opened == (_index_map(path)["model.norm.weight"],)


def test_missing_required_tensors_list_first_20_and_count(hf_llama):
    """Asking for 30 layers of a 2-layer checkpoint names the first 20 missing and counts the rest."""
    path, _ = hf_llama
    with pytest.raises(MissingTensorsError) as excinfo:
        load_checkpoint(path, LLAMA_PATTERNS, {"layer": range(30)})
    err = excinfo.value
    assert len(err.missing) == 28 * 9
    assert err.missing[0] == "model.layers.2.input_layernorm.weight"
    msg = str(err)
    assert f"{28 * 9} required tensor(s)" in msg and f"(and {28 * 9 - 20} more)" in msg
    assert msg.count("'model.layers.") == 20
    assert isinstance(err, CheckpointError)


def test_required_pattern_without_placeholders_must_exist(hf_llama):
    """A literal pattern is required: no silent fallback."""
    with pytest.raises(MissingTensorsError) as excinfo:
        load_checkpoint(hf_llama[0], ["model.norm.weight", "mtp.norm.weight"], {})
    assert excinfo.value.missing == ("mtp.norm.weight",)


def test_placeholder_without_range_is_optional(tmp_path):
    """``{expert}`` without a range loads whatever experts exist and requires none."""
    save_file(
        {
            "layers.0.experts.0.w": torch.zeros(1),
            "layers.0.experts.7.w": torch.ones(1),
            "layers.1.experts.3.w": torch.ones(1),
            "layers.0.gate": torch.ones(1),
        },
        tmp_path / "model.safetensors",
    )
    w = load_checkpoint(
        tmp_path,
        ["layers.{layer}.experts.{expert}.w", "layers.{layer}.bias.{n}"],
        {"layer": range(1)},
    )
    assert sorted(w) == ["layers.0.experts.0.w", "layers.0.experts.7.w"]


def test_ranged_placeholder_restricts_the_indices_loaded(hf_llama):
    """A 1-layer draft of a 2-layer checkpoint loads layer 0 only."""
    w = load_checkpoint(hf_llama[0], LLAMA_PATTERNS, {"layer": range(1)})
    assert not any(n.startswith("model.layers.1.") for n in w)
    assert "model.layers.0.mlp.up_proj.weight" in w


@pytest.mark.parametrize(
    ("name", "wanted"),
    [
        ("a.3.b", True),
        ("a.12.b", True),
        ("a.3.b.c", False),  # full match
        ("xa.3.b", False),
        ("a.x.b", False),  # decimal index only
        ("a.03.b", False),  # canonical decimal
        ("a.-1.b", False),
        ("aX3Xb", False),  # dots are literal
    ],
)
def test_pattern_matching_rules(name, wanted):
    """``{i}`` is one decimal index, the rest literal, and the whole name must match."""
    assert WeightSelection.from_patterns(["a.{i}.b"]).wants(name) is wanted


def test_repeated_placeholder_must_repeat_its_index():
    """The same placeholder twice in a pattern means the same index."""
    sel = WeightSelection.from_patterns(["l.{i}.to.{i}"], {"i": range(3)})
    assert sel.required == {"l.0.to.0", "l.1.to.1", "l.2.to.2"}
    opt = WeightSelection.from_patterns(["l.{i}.to.{i}"])
    assert opt.wants("l.4.to.4") and not opt.wants("l.4.to.5")


@pytest.mark.parametrize("bad", ["a.{}.b", "a.{1x}.b", "a.{i.b", "a}.b", ""])
def test_malformed_pattern_is_a_value_error(bad):
    """A pattern with stray braces or no name is the plugin's bug, reported with the pattern."""
    with pytest.raises(ValueError, match="weight pattern"):
        WeightSelection.from_patterns([bad])


def test_expected_shapes_mismatch_names_tensor_expected_and_actual(hf_llama):
    """Shapes are checked from the headers; the message names tensor, expected and actual shape."""
    path, _ = hf_llama
    good = {"model.layers.{layer}.self_attn.k_proj.weight": (16, 32), "model.norm.weight": [32]}
    w = load_checkpoint(path, LLAMA_PATTERNS, {"layer": range(2)}, expected_shapes=good)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)
    bad = {"model.layers.{layer}.self_attn.k_proj.weight": (32, 32)}
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path, LLAMA_PATTERNS, {"layer": range(2)}, expected_shapes=bad)
    msg = str(excinfo.value)
    assert "'model.layers.0.self_attn.k_proj.weight' expected [32, 32], got [16, 32]" in msg
    assert "model.layers.1.self_attn.k_proj.weight" in msg


def test_slices_read_only_a_rank_part(hf_llama):
    """``slices`` reads one (dim, start, stop) part per tensor, and counts only those bytes."""
    path, state = hf_llama
    up, down = (
        "model.layers.{layer}.mlp.up_proj.weight",
        "model.layers.{layer}.mlp.down_proj.weight",
    )
    w = load_checkpoint(
        path, [up, down], {"layer": range(2)}, slices={up: (0, 16, 32), down: (1, 0, 32)}
    )
    for i in range(2):
        assert torch.equal(
            w[f"model.layers.{i}.mlp.up_proj.weight"],
            state[f"model.layers.{i}.mlp.up_proj.weight"][16:32],
        )
        assert torch.equal(
            w[f"model.layers.{i}.mlp.down_proj.weight"],
            state[f"model.layers.{i}.mlp.down_proj.weight"][:, 0:32],
        )
    assert w.stats.tensor_bytes_read == 2 * (16 * 32 + 32 * 32) * 4
    with pytest.raises(
        CheckpointError,
        match=r"slice \(dim=1, 0:65\) does not fit tensor 'model.layers.0.mlp.up_proj.weight' of shape \[64, 32\]",
    ):
        load_checkpoint(path, [up], {"layer": range(1)}, slices={up: (1, 0, 65)})


def _overwrite_data_in_place(path: Path) -> None:
    """Rewrite every tensor byte of a file in place (same inode, same size)."""
    n = int.from_bytes(path.read_bytes()[:8], "little")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(8 + n)
        f.write(b"\x7f" * (size - 8 - n))


def test_tensors_own_their_memory_by_default(tmp_path):
    """Loaded tensors are copies: rewriting or truncating the file afterwards changes nothing."""
    save_file({"x": torch.arange(4.0)}, tmp_path / "model.safetensors")
    w = load_checkpoint(tmp_path, ["x"], {})
    _overwrite_data_in_place(tmp_path / "model.safetensors")
    assert torch.equal(w["x"], torch.arange(4.0))
    os.truncate(tmp_path / "model.safetensors", 0)  # a view of the mapping would now SIGBUS
    assert torch.equal(w["x"], torch.arange(4.0))


def test_lazy_tensors_are_views_of_the_mapped_file(tmp_path):
    """With lazy=True a tensor is a view of the file mapping: a rewrite in place shows through."""
    save_file({"x": torch.arange(4.0)}, tmp_path / "model.safetensors")
    w = load_checkpoint(tmp_path, ["x"], {}, lazy=True)
    _overwrite_data_in_place(tmp_path / "model.safetensors")
    assert not torch.equal(w["x"], torch.arange(4.0))
    converted = load_checkpoint(tmp_path, ["x"], {}, lazy=True, dtype=torch.float64)
    assert converted["x"].dtype == torch.float64  # converted tensors are always copies


def test_device_meta(hf_llama):
    """Tensors move to the requested device."""
    w = load_checkpoint(hf_llama[0], ["model.norm.weight"], {}, device="meta")
    assert w["model.norm.weight"].is_meta


def test_one_log_line_and_no_progress_bar_off_terminal(hf_llama, caplog, capfd):
    """Off a terminal: one INFO line "loaded X tensors (Y MB) from M of N shards", stderr silent."""
    path, _ = hf_llama
    with caplog.at_level(logging.INFO, logger="rtpcore.checkpoint.loader"):
        w = load_checkpoint(path, ["model.norm.weight", "lm_head.weight"], {})
    lines = [r.getMessage() for r in caplog.records if r.name == "rtpcore.checkpoint.loader"]
    n = len(w.stats.files_opened)
    assert lines == [f"loaded 2 tensors (0.0 MB) from {n} of {w.stats.shards_total} shards"]
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_progress_bar_on_a_terminal(hf_llama):
    """With stderr on a terminal (a real pty), a tqdm bar over the shards is drawn."""
    code = textwrap.dedent(
        f"""
        from rtpcore.checkpoint import load_checkpoint
        load_checkpoint({str(hf_llama[0])!r}, {LLAMA_PATTERNS!r}, {{"layer": range(2)}})
        """
    )
    parent, child = pty.openpty()
    # A fresh pty has 0 columns, where tqdm draws nothing: give it a size.
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.run([sys.executable, "-c", code], stderr=child, timeout=300, check=True)
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(parent, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(parent)
    assert proc.returncode == 0
    assert b"loading shards" in out and b"100%" in out


def test_read_hf_config(hf_llama, tmp_path):
    """config.json parses from the directory or the file; a bad one is a CheckpointError naming it."""
    cfg = read_hf_config(hf_llama[0])
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert read_hf_config(hf_llama[0] / "config.json") == cfg
    with pytest.raises(CheckpointError, match=r"config.json not found") as excinfo:
        read_hf_config(tmp_path)
    assert excinfo.value.path == tmp_path / "config.json"
    with pytest.raises(CheckpointError, match=r"config.json not found: '.*/nope/config.json'"):
        read_hf_config(tmp_path / "nope")
    (tmp_path / "config.json").write_text('{"architectures": [')
    with pytest.raises(CheckpointError, match=r"config.json '.*config.json' is not valid JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object, got list"):
        read_hf_config(tmp_path)
