"""GGUF weights kept in their blocks view the file mapping (docs/design.md §20): loading copies
nothing it can use as stored, the pages are the page cache's (file-backed, shared), nothing writes
to them, the mapping lives as long as a weight views it, and a model on views computes exactly what
the same model on copies of the bytes computes. Float weights view a copy-on-write mapping: a write
stays in the process. The header reads as the package's own reader reads it (tests/test_gguf.py).

Memory is read from ``/proc/self/status`` (``RssFile``: resident pages of mapped files, ``RssAnon``:
the process's own) and ``/proc/self/maps``: Linux only.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
if not Path("/proc/self/maps").exists():
    pytest.skip("reads /proc/self/maps and /proc/self/status (Linux)", allow_module_level=True)

from rtpcore import Engine  # noqa: E402
from rtpcore.checkpoint import load_checkpoint, read_hf_config  # noqa: E402
from rtpcore.checkpoint.gguf import open_gguf  # noqa: E402
from rtpcore.checkpoint.gguf.blocks import GGUFBlocks  # noqa: E402
from rtpcore.checkpoint.gguf.reader import release_gguf_files  # noqa: E402
from rtpcore.models.layers import Linear, weight_quantization  # noqa: E402
from rtpcore.models.llama import LlamaPlugin  # noqa: E402
from rtpcore.quantization import GgufMethod  # noqa: E402
from test_gguf import PROMPTS, convert  # noqa: E402
from test_llama import teacher_forced_logits  # noqa: E402


def mappings(path: Path) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of each mapping of ``path`` in this process."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, fields[1]))
    return out


def rss_kib() -> dict[str, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(status[k].split()[0]) for k in ("RssAnon", "RssFile")}


def inside(t: torch.Tensor, spans: list[tuple[int, int, str]]) -> bool:
    end = t.data_ptr() + t.numel() * t.element_size()
    return any(lo <= t.data_ptr() and end <= hi for lo, hi, _ in spans)


def test_weights_in_blocks_are_views_of_the_read_only_mapping(tmp_path: Path) -> None:
    """Every Linear's blocks and the token embedding lie inside the file's read-only, shared
    mapping (``r--s``), except the fused qkv: llama.cpp's converter permuted the
    Q/K rows, which are put back in one fresh buffer. gate_up is a view where the file stores
    gate and up back to back, else one buffer too."""
    _, path = convert(tmp_path, "llama-gqa", "Q8_0")
    checkpoint = open_gguf(path)
    gate, up = checkpoint.tensor("blk.0.ffn_gate.weight"), checkpoint.tensor("blk.0.ffn_up.weight")
    back_to_back = gate.offset + gate.nbytes == up.offset
    with Engine.from_pretrained(path, tokens_per_block=4) as engine:
        spans = [s for s in mappings(path) if s[2] == "r--s"]  # (the norms view a copy-on-write one)
        assert spans
        model = engine.model
        assert inside(model.embed.parts[0][1], spans)
        for layer in model.layers:
            assert inside(layer.o.weight, spans) and inside(layer.down.weight, spans)
            assert not inside(layer.qkv.weight, spans)
            assert inside(layer.gate_up.weight, spans) == back_to_back
        assert inside(model.lm_head.weight, spans)
        engine.generate(PROMPTS, max_new_tokens=4, stop_token_ids=[])  # reads them: a write would fault


def _big_q8_0_file(path: Path, rows: int, cols: int) -> Path:
    """A GGUF file holding one Q8_0 tensor of random bytes (never dequantized here)."""
    writer = gguf.GGUFWriter(path, "llama")
    data = np.random.default_rng(0).integers(0, 256, (rows, cols // 32 * 34), dtype=np.uint8)
    writer.add_tensor("big.weight", data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_reading_a_loaded_weight_maps_file_pages_not_process_memory(tmp_path: Path) -> None:
    """Loading a 32 MiB Q8_0 tensor in its blocks and reading every page of it grows the resident
    file-backed pages (the page cache's, shared with any other process mapping the file) by about
    its size, and the process's own memory by a fraction of it."""
    path = _big_q8_0_file(tmp_path / "big.gguf", 8192, 3840)  # 8192 rows of 4080 bytes: 32 MiB
    size = open_gguf(path).tensor("big.weight").nbytes
    before = rss_kib()
    weights = load_checkpoint(path, ["big.weight"], quantization=GgufMethod())
    [(kind, data)] = weights["big.weight"].parts
    assert kind == "q8_0" and data.shape == (8192, 4080)
    assert int(data.view(-1)[::4096].sum()) > 0  # one byte of every page
    after = rss_kib()
    assert (after["RssFile"] - before["RssFile"]) * 1024 >= 0.9 * size, (before, after, size)
    assert (after["RssAnon"] - before["RssAnon"]) * 1024 <= 0.25 * size, (before, after, size)
    assert inside(data, mappings(path))


def _engine_tokens_then_close(path: Path) -> list[list[int]]:
    with Engine.from_pretrained(path, tokens_per_block=4) as engine:
        assert mappings(path)
        return engine.generate(PROMPTS, max_new_tokens=6, stop_token_ids=[])


def test_closing_the_engine_unmaps_the_file(tmp_path: Path) -> None:
    """The mapping lives while the engine's weights view it; once the engine is closed (and its
    objects collected) the file is no longer mapped."""
    _, path = convert(tmp_path, "llama-tied", "Q4_0")
    release_gguf_files()
    tokens = _engine_tokens_then_close(path)
    gc.collect()
    assert tokens and mappings(path) == []


def test_a_model_on_views_computes_what_it_computes_on_copies(tmp_path: Path) -> None:
    """The engine's model (weights viewing the mapping) and the same model built from fresh copies
    of the same bytes give bit-identical logits, teacher-forced on the engine's greedy tokens --
    so the greedy tokens are those of the copies too."""
    hf, path = convert(tmp_path, "llama-gqa", "Q8_0")
    config = read_hf_config(path)
    names = LlamaPlugin.gguf_tensor_names(open_gguf(path), config)
    weights = load_checkpoint(path, list(hf.state_dict()), tensor_names=names, quantization=GgufMethod())
    copies = {
        n: GGUFBlocks([(kind, d.clone()) for kind, d in w.parts], w.shape[1], w.dtype) if isinstance(w, GGUFBlocks)
        else w.clone()
        for n, w in weights.items()
    }
    spans = mappings(path)
    assert all(not inside(d, spans) for w in copies.values() if isinstance(w, GGUFBlocks) for _, d in w.parts)
    with weight_quantization(GgufMethod()):
        copied = LlamaPlugin.build_model(LlamaPlugin.config_from_hf(config), copies, dtype=torch.float32,
                                         device="cpu").eval()
    assert {m.kernel for m in copied.modules() if isinstance(m, Linear)} == {"gguf"}
    with Engine.from_pretrained(path, tokens_per_block=4) as engine:
        tokens = engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[])
        seqs = [p + t for p, t in zip(PROMPTS, tokens, strict=True)]
        order = sorted(range(len(seqs)), key=lambda i: -(len(seqs[i]) - len(PROMPTS[i])))
        args = ([seqs[i] for i in order], [len(PROMPTS[i]) for i in order])
        viewed = teacher_forced_logits(engine.model, engine.kv_caches, *args)
        on_copies = teacher_forced_logits(copied, engine.kv_caches, *args)
    for i, v, c in zip(order, viewed, on_copies, strict=True):
        assert torch.equal(v, c)
        assert c[:-1].argmax(-1).tolist() == tokens[i]


BUILD_CHILD = r"""
import json, sys
import torch
from rtpcore import Engine
before = "torch.distributed.tensor" in sys.modules
with Engine.from_pretrained(sys.argv[1], tokens_per_block=4) as engine:
    engine.generate([[5, 9, 33, 7, 81]], max_new_tokens=3, stop_token_ids=[])
print(json.dumps({"before": before, "after": "torch.distributed.tensor" in sys.modules}))
"""


def test_building_and_running_a_gguf_model_stays_out_of_torchs_dispatcher(tmp_path: Path) -> None:
    """The operations a model builds with on GGUFBlocks (Parameter, cat, slices, to, embedding) are
    answered before torch's dispatcher, whose first call into a Python subclass imports
    torch.distributed.tensor (about a second of the load)."""
    _, path = convert(tmp_path, "llama-tied", "Q8_0")
    proc = subprocess.run([sys.executable, "-c", BUILD_CHILD, str(path)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    if seen["before"]:
        pytest.skip("this torch imports torch.distributed.tensor with rtpcore")
    assert not seen["after"]


def test_float_weights_view_a_copy_on_write_mapping(tmp_path: Path) -> None:
    """An F32 file's weights the model keeps as float32 view a private (copy-on-write) mapping of
    the file: nothing is copied at load, and a model that writes a weight in place changes its
    own copy of the page, never the file (nor does it fault)."""
    _, path = convert(tmp_path, "llama-gqa", "F32")
    before = path.read_bytes()
    weights = load_checkpoint(path, ["model.layers.0.self_attn.o_proj.weight", "model.norm.weight"],
                              tensor_names=LlamaPlugin.gguf_tensor_names(open_gguf(path), read_hf_config(path)))
    o, norm = weights["model.layers.0.self_attn.o_proj.weight"], weights["model.norm.weight"]
    private = [s for s in mappings(path) if s[2] == "rw-p"]
    assert o.dtype == torch.float32 and inside(o, private) and inside(norm, private)
    kept = o.clone()
    o.mul_(2)
    assert torch.equal(o, 2 * kept)
    assert path.read_bytes() == before
    with Engine.from_pretrained(path, tokens_per_block=4) as engine:
        private = [s for s in mappings(path) if s[2] == "rw-p"]
        assert inside(engine.model.layers[0].o.weight, private)
        assert not inside(engine.model.layers[0].qkv.weight, private)  # fused: a buffer of its own


def _resident_pages(spans: list[tuple[int, int, str]]) -> set[int]:
    """The virtual page numbers of ``spans`` that are mapped into this process now
    (``/proc/self/pagemap``: bit 63 of each page's entry)."""
    page = os.sysconf("SC_PAGE_SIZE")
    out: set[int] = set()
    with open("/proc/self/pagemap", "rb") as f:
        for lo, hi, _ in spans:
            f.seek(lo // page * 8)
            entries = np.frombuffer(f.read((hi - lo) // page * 8), dtype=np.uint64)
            present = np.nonzero(entries >> np.uint64(63))[0]
            out.update(int(p) + lo // page for p in present)
    return out


def _pages(t: torch.Tensor) -> set[int]:
    page = os.sysconf("SC_PAGE_SIZE")
    end = t.data_ptr() + t.numel() * t.element_size()
    return set(range(t.data_ptr() // page, (end - 1) // page + 1))


@pytest.mark.parametrize("file_type", ["F32", "Q8_0"])
def test_pages_only_copied_weights_read_are_given_back(tmp_path: Path, file_type: str) -> None:
    """The weights a model copies at build -- q, k and v joined into the fused qkv (q and k put
    back in the order the converter permuted), an F32 file's gate and up joined likewise -- read
    the file's pages once: after the build those pages are unmapped (they would count resident a
    second time beside the copies), while every page a weight the model keeps views stays
    mapped, and an F32 model computes the tokens of its safetensors checkpoint."""
    from gguf_files import write_gguf
    from test_gguf import BOS, EOS
    from test_llama import make_checkpoint
    from tokenizer_files import byte_bpe

    # q of Q8_0 rows 512 wide: 68 pages, more than the kernel's fault-around window (16)
    make_checkpoint(tmp_path / "st", "llama-gqa", vocab_size=420, hidden_size=512, intermediate_size=1024)
    path = write_gguf(tmp_path / "st", tmp_path / f"m-{file_type}.gguf", file_type=file_type, tokenizer=byte_bpe(),
                      bos=BOS, eos=EOS)
    copied = ("attn_q", "attn_k", "attn_v") + (("ffn_gate", "ffn_up") if file_type == "F32" else ())
    sources = [t for t in open_gguf(path).tensors.values() if t.name.split(".")[-2] in copied]
    release_gguf_files()
    with Engine.from_pretrained(tmp_path / "st", tokens_per_block=4) as engine:
        want = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    with Engine.from_pretrained(path, tokens_per_block=4) as engine:
        got = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
        if file_type == "F32":  # the same float weights: the same tokens (Q8_0's are its own)
            assert got == want
        kind = "rw-p" if file_type == "F32" else "r--s"
        model = engine.model
        # (the tokenizer's reading of the header maps the file again)
        [span] = [s for s in mappings(path) if s[2] == kind and inside(model.layers[0].o.weight, [s])]
        viewed: set[int] = set()
        for t in [*model.parameters(), *model.buffers()]:
            for v in t.storage_views() if isinstance(t, GGUFBlocks) else (t,):
                if inside(v, [span]):
                    viewed |= _pages(v)
        fused = [layer.qkv.weight for layer in model.layers]
        if file_type == "F32":
            fused += [layer.gate_up.weight for layer in model.layers]
        assert not any(inside(w, [span]) for w in fused)  # the copies, in the process's own memory
        page = os.sysconf("SC_PAGE_SIZE")
        read = set().union(*(range((span[0] + t.offset) // page, (span[0] + t.offset + t.nbytes - 1) // page + 1)
                             for t in sources)) - viewed
        resident = _resident_pages([span]) & read
        # A fault maps the page cache's pages around the one it faults in (the kernel's
        # fault-around): a few pages beside a kept weight's come back that way.
        assert len(resident) <= 0.1 * len(read), f"{len(resident)} of the {len(read)} pages only copies read"
        # every page of the kept products every step reads (o, down) is mapped: read by the generation
        products = [w for layer in model.layers for w in (layer.o.weight, layer.down.weight)]
        assert set().union(*map(_pages, products)) <= _resident_pages([span])
