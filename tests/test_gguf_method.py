"""The built-in ``gguf`` quantization method (docs/design.md §18, §20): a GGUF file's quantized
weights stay in their blocks from the file to the kernel.

The reference each test compares against is the same file with every weight dequantized to
float32 at load (``quantization="none"``). Two implementations multiply the blocks
(``rtpcore.checkpoint.gguf.linear``): rtpcore_native's GGUF kernels where the build has them, which
quantize the activations per block of 32 to 8 bits as llama.cpp does, and otherwise the
reference path, which dequantizes the weights per call and is exact. The bounds:

* logits: within :func:`logit_bound` of the dequantized engine's -- float32 rounding (the two
  engines sum in different orders) for the reference path; for the native kernels
  ``NATIVE_SHARE`` (12%) of the largest reference logit of the sequence: each product is within
  about 0.5% of its value (8-bit activations, tests/test_gguf_kernels.py bounds one product), and
  teacher-forced through every layer of these random-weight models over 40 positions that grows to
  0.40-0.41 on logits reaching about 5 (8% of the largest);
* greedy tokens (the near-tie rule): every token the method's engine picks is within
  :func:`logit_bound` of the best logit of the dequantized engine at that position, teacher-forced on
  the method's tokens, and with the exact reference path the tokens are the same.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from rtpcore import Engine  # noqa: E402
from rtpcore.checkpoint import load_checkpoint, read_hf_config  # noqa: E402
from rtpcore.checkpoint.gguf import open_gguf  # noqa: E402
from rtpcore.checkpoint.gguf.blocks import GGUF_BLOCK_TYPES, GGUFBlocks, gguf_native  # noqa: E402
from rtpcore.errors import CheckpointError, RtpcoreError  # noqa: E402
from rtpcore.models.layers import Linear, weight_quantization  # noqa: E402
from rtpcore.models.llama import LlamaPlugin  # noqa: E402
from rtpcore.quantization import BUILTIN_QUANTIZATION_METHODS, GgufMethod  # noqa: E402
from test_gguf import PROMPTS, convert  # noqa: E402
from test_llama import teacher_forced_logits  # noqa: E402

NATIVE = gguf_native() is not None
NATIVE_SHARE = 0.12  # of the largest reference logit (the module docstring)


def logit_bound(reference: torch.Tensor) -> float:
    """How far the method's logits may be from ``reference`` (the dequantized engine's)."""
    return NATIVE_SHARE * reference.abs().max().item() if NATIVE else 1e-4


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a model's weights take: its parameters and its Linear layers' buffers (not the
    RoPE tables), each byte counted once (a tied head shares the embedding's blocks; weights kept
    in blocks are views of one storage, the file's mapping)."""
    spans: list[tuple[int, int]] = []

    def count(t: torch.Tensor | None) -> None:
        if t is None:
            return
        if isinstance(t, GGUFBlocks):
            for _, data in t.parts:
                count(data)
            return
        assert t.is_contiguous()
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))

    for p in model.parameters():
        count(p)
    for m in model.modules():
        if isinstance(m, Linear):
            for b in m.buffers(recurse=False):
                count(b)
    total, end = 0, 0
    for lo, hi in sorted(spans):
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total


def dequantized_logits(path: Path, seqs: list[list[int]], prefill: list[int], **options: Any) -> list[torch.Tensor]:
    with Engine.from_pretrained(path, tokens_per_block=4, **options) as engine:
        return teacher_forced_logits(engine.model, engine.kv_caches, seqs, prefill)


@pytest.mark.parametrize(("variant", "file_type"), [("llama-gqa", "Q8_0"), ("llama-tied", "Q4_0"),
                                                    ("qwen2-bias", "Q5_1")])
def test_a_quantized_file_is_served_from_its_blocks_close_to_the_dequantized_file(
    tmp_path: Path, variant: str, file_type: str
) -> None:
    """A Q8_0 / Q4_0 / Q5_1 file served through the Engine keeps every linear weight (and the
    token embedding, tied or not) as the file's bytes, within 10% of the file's tensor bytes; its
    logits are within logit_bound() of the same file dequantized to float32, and its greedy tokens
    follow the near-tie rule (the module doc)."""
    _, path = convert(tmp_path, variant, file_type)
    file_bytes = open_gguf(path).tensor_bytes
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 420, (n,), generator=gen).tolist() for n in (40, 31, 20)]
    prefill = [13, 7, 20]
    with Engine.from_pretrained(path, tokens_per_block=4) as engine:
        model = engine.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert {m.kernel for m in linears} == {"gguf"}
        for m in linears:  # no float weight: only the blocks (and a float bias)
            assert m.weight.dtype == torch.uint8 and m.gguf_parts == ((file_type.lower(), m.out_features),)
            assert m.weight.shape == (m.out_features, m.in_features // 32 * {"Q8_0": 34, "Q4_0": 18, "Q5_1": 24}[
                file_type])
            assert m.weight_fp32 is None and m.bias_fp32 is None
        assert isinstance(model.embed, GGUFBlocks) and model.embed.gguf_types == (file_type.lower(),)
        resident = weight_bytes(model)
        assert abs(resident - file_bytes) <= 0.1 * file_bytes, (resident, file_bytes)
        got = teacher_forced_logits(model, engine.kv_caches, seqs, prefill)
        tokens = engine.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    ref = dequantized_logits(path, seqs, prefill, quantization="none")
    for g, r in zip(got, ref, strict=True):
        assert (g - r).abs().max().item() <= logit_bound(r)
    with Engine.from_pretrained(path, quantization="none") as engine:
        assert {m.kernel for m in engine.model.modules() if isinstance(m, Linear)} == {"plain"}
        want = engine.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    if not NATIVE:
        assert tokens == want
    # the near-tie rule: the dequantized engine's logits on the method's tokens
    forced = [p + t for p, t in zip(PROMPTS, tokens, strict=True)]
    order = sorted(range(len(forced)), key=lambda i: -(len(tokens[i]) + 1))  # longest tail first
    logits = dequantized_logits(path, [forced[i] for i in order], [len(PROMPTS[i]) for i in order],
                                quantization="none")
    for i, lg in zip(order, logits, strict=True):
        lg = lg[:-1]  # (24, V): after the prompt and after each new token but the last
        chosen = lg.gather(1, torch.tensor(tokens[i])[:, None])[:, 0]
        assert (lg.amax(-1) - chosen).max().item() <= logit_bound(lg)


def test_the_tied_embedding_shares_its_blocks_with_the_head(tmp_path: Path) -> None:
    """A tied model's head multiplies the embedding's own bytes (no second copy), and looking up
    a token dequantizes its row to what the dequantized file holds."""
    _, path = convert(tmp_path, "llama-tied", "Q8_0")
    with Engine.from_pretrained(path) as engine:
        model = engine.model
        assert model.lm_head.weight.data_ptr() == model.embed.parts[0][1].data_ptr()
        ids = torch.tensor([[0, 5], [419, 5]])
        rows = torch.nn.functional.embedding(ids, model.embed)
    names = LlamaPlugin.gguf_tensor_names(open_gguf(path), read_hf_config(path))
    dense = load_checkpoint(path, ["model.embed_tokens.weight"], tensor_names=names)["model.embed_tokens.weight"]
    assert rows.dtype == torch.float32 and rows.shape == (2, 2, 64)
    assert torch.equal(rows, dense[ids])


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0", "Q5_0", "F16"])
def test_unpermuted_rows_on_bytes_equal_the_dequantized_then_unpermuted_weights(tmp_path: Path, file_type: str) -> None:
    """Q and K rows llama.cpp's converter permuted are put back on the byte rows: dequantized,
    they equal the dequantize-then-unpermute reading exactly; every other tensor too."""
    hf, path = convert(tmp_path, "llama-gqa", file_type)
    names = LlamaPlugin.gguf_tensor_names(open_gguf(path), read_hf_config(path))
    wanted = [n for n in hf.state_dict() if n.endswith(".weight")]
    blocks = load_checkpoint(path, wanted, tensor_names=names, quantization=GgufMethod())
    dense = load_checkpoint(path, wanted, tensor_names=names)
    kept = {n for n, t in blocks.items() if isinstance(t, GGUFBlocks)}
    assert kept == {n for n, t in dense.items() if t.dim() == 2}
    for name in wanted:
        got = blocks[name].dequantize() if name in kept else blocks[name]
        assert torch.equal(got, dense[name].float()), name


def test_gguf_on_a_safetensors_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    convert(tmp_path, "llama-gqa", "Q8_0")
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(tmp_path / "st", quantization="gguf")
    assert "'gguf' multiplies the weights of a GGUF checkpoint" in str(excinfo.value)
    assert "this checkpoint is not one (its config.json has no quantization_config)" in str(excinfo.value)


def test_an_unknown_quantization_lists_none_and_gguf(tmp_path: Path) -> None:
    convert(tmp_path, "llama-gqa", "Q8_0")
    with pytest.raises(RtpcoreError, match="quantization must be None, 'none' or one of fp8, gguf, int8, got 'q4'"):
        Engine.from_pretrained(tmp_path / "st", quantization="q4")


def test_int8_on_a_gguf_file_quantizes_its_dequantized_weights(tmp_path: Path) -> None:
    _, path = convert(tmp_path, "llama-gqa", "Q8_0")
    with Engine.from_pretrained(path, quantization="int8") as engine:
        assert {m.kernel for m in engine.model.modules() if isinstance(m, Linear)} == {"int8"}
        assert len(engine.generate(PROMPTS[:1], max_new_tokens=4, stop_token_ids=[])[0]) == 4


def test_the_method_is_registered_and_listed(capsys: pytest.CaptureFixture[str]) -> None:
    """`rtpcore plugins list` shows the built-in gguf method; it keeps the types the loader keeps."""
    import json

    from rtpcore.cli import main

    assert main(["plugins", "list", "--json"]) == 0
    builtin = next(r for r in json.loads(capsys.readouterr().out) if r["builtin"])
    assert "gguf" in builtin["seams"]["quantization_methods"]
    assert "gguf" in BUILTIN_QUANTIZATION_METHODS
    assert GgufMethod.gguf_types == GGUF_BLOCK_TYPES


# -- GGUFBlocks and Linear over them -------------------------------------------------------------


def _blocks(kind: str, rows: int, cols: int, seed: int) -> tuple[GGUFBlocks, torch.Tensor]:
    """Random weights quantized to ``kind``: the blocks and their dequantized values."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if kind == "f16":
        raw = w.astype(np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(w, GGMLQuantizationType[kind.upper()])
    t = GGUFBlocks([(kind, torch.from_numpy(raw.copy()))], cols)
    return t, t.dequantize()


def test_a_linear_over_rows_of_several_types_equals_its_dequantized_weights() -> None:
    """torch.cat of blocks of different types (a Q4_K_M file's fused qkv) keeps each type's rows;
    a Linear built from it computes x @ W.T + b of the dequantized W (exactly on the reference
    path, within the activations' 8-bit rounding on the native kernels)."""
    q, qd = _blocks("q8_0", 24, 64, 0)
    k, kd = _blocks("q8_0", 8, 64, 1)
    v, vd = _blocks("q4_0", 8, 64, 2)
    w = torch.cat([q, k, v])
    assert isinstance(w, GGUFBlocks) and w.gguf_types == ("q8_0", "q4_0") and w.shape == (40, 64)
    dense = torch.cat([qd, kd, vd])
    bias = torch.randn(40)
    x = torch.randn(3, 5, 64)
    with weight_quantization(GgufMethod()):
        layer = Linear(w, bias)
    assert layer.kernel == "gguf" and layer.weight is None and layer.gguf_parts == (("q8_0", 32), ("q4_0", 8))
    want = torch.nn.functional.linear(x, dense, bias)
    got = layer(x)
    assert got.shape == (3, 5, 40)
    if NATIVE:
        assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
    else:
        assert torch.equal(got, want)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_blocks_follow_the_operations_a_model_builds_with(caplog: pytest.LogCaptureFixture) -> None:
    """to(dtype) / Parameter / row slices / embedding stay on the bytes; any other operation
    dequantizes first (logged once) and gives the float result."""
    w, dense = _blocks("q5_1", 16, 64, 3)
    half = w.to(torch.bfloat16)
    assert isinstance(half, GGUFBlocks) and half.dtype == torch.bfloat16 and half.parts[0][1] is w.parts[0][1]
    p = torch.nn.Parameter(w, requires_grad=False)
    assert isinstance(p, GGUFBlocks) and p.parts[0][1] is w.parts[0][1]
    rows = w[4:10]
    assert isinstance(rows, GGUFBlocks) and torch.equal(rows.dequantize(), dense[4:10])
    assert torch.equal(torch.nn.functional.embedding(torch.tensor([3, 15]), w), dense[[3, 15]])
    with caplog.at_level(logging.WARNING, logger="rtpcore.checkpoint.gguf.blocks"):
        out = w.t() @ torch.ones(16)
        w.t()
    assert torch.equal(out, dense.t() @ torch.ones(16))
    assert [r.getMessage() for r in caplog.records if "aten.t" in r.getMessage()][:1]
    assert len([r for r in caplog.records if "aten.t" in r.getMessage()]) <= 1


@pytest.mark.skipif(not NATIVE, reason="the native kernels report the CPU's vendor")
def test_gemm_rows_follow_the_cpus_vendor_and_kernel_set() -> None:
    """The thresholds in force are those of this CPU: CPUID's vendor string is the kernel's
    (/proc/cpuinfo's vendor_id), an EPYC's tables (its float32 GEMM slower per cycle) start
    torch's GEMM later than a Xeon's for every type, later still for the K types, and with VNNI
    (on an EPYC, AVX2 as well) the 32-element types never leave the block kernels."""
    from rtpcore.checkpoint.gguf import linear

    vendor = gguf_native().cpu_vendor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        ids = {line.partition(":")[2].strip() for line in cpuinfo.read_text().splitlines()
               if line.startswith("vendor_id")}
        if ids:
            assert ids == {vendor}
    assert linear.gemm_rows(vendor, gguf_native().default_isa()) == linear.GEMM_ROWS
    old = linear.gemm_rows("GenuineIntel", "avx512")  # no byte dot products
    assert old == linear.gemm_rows("", "avx2") == linear.GEMM_ROWS_INTEL
    for kernel_set, table in (("avx512", linear.GEMM_ROWS_AMD), ("avx2", linear.GEMM_ROWS_AMD_AVX2)):
        amd = linear.gemm_rows("AuthenticAMD", kernel_set)
        assert set(amd) == set(old) == set(GGUF_BLOCK_TYPES)
        assert all(amd[t] >= old[t] for t in old) and min(amd[t] for t in ("q4_k", "q5_k", "q6_k")) >= 512
        # an EPYC's byte-dot-product GEMM (AVX2's too) wins at every row count; the K types keep the table's
        assert {t for t, rows in amd.items() if rows == linear.NEVER} == {"q8_0", "q4_0", "q5_0", "q5_1"}
        assert all(amd[t] == table[t] for t in ("q4_k", "q5_k", "q6_k", "f16"))
    for vendor in ("GenuineIntel", "AuthenticAMD"):  # with VNNI the GEMM over repacked blocks always wins
        vnni = linear.gemm_rows(vendor, "avx512_vnni")
        assert {t for t, rows in vnni.items() if rows == linear.NEVER} == {"q8_0", "q4_0", "q5_0", "q5_1"}
        assert vnni["q4_k"] == linear.gemm_rows(vendor, "avx512")["q4_k"]


def test_many_rows_take_the_dequantized_weight_and_torchs_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """From GEMM_ROWS[type] rows (a prefill chunk) the native path multiplies each part's weight
    dequantized into a scratch buffer: float32 activations, so the product equals F.linear of the
    dequantized weight within float32 rounding, for a weight of several types too; fewer rows keep
    the block kernels, and each part decides by its own type's threshold."""
    from rtpcore.checkpoint.gguf.linear import GEMM_ROWS

    monkeypatch.setitem(GEMM_ROWS, "q8_0", 32)  # with VNNI the block kernels take every row count
    monkeypatch.setitem(GEMM_ROWS, "q4_0", 32)
    q, qd = _blocks("q8_0", 24, 64, 3)
    v, vd = _blocks("q4_0", 8, 64, 4)
    dense = torch.cat([qd, vd])
    bias = torch.randn(32)
    with weight_quantization(GgufMethod()):
        layer = Linear(torch.cat([q, v]), bias)
    x = torch.randn(max(GEMM_ROWS["q8_0"], GEMM_ROWS["q4_0"]) + 5, 64)
    want = torch.nn.functional.linear(x, dense, bias)
    got = layer(x)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    if NATIVE:  # a few rows: 8-bit activations, not exact
        few = layer(x[:4])
        assert not torch.equal(few, want[:4])
        assert (few - want[:4]).abs().max().item() <= 0.02 * want.abs().max().item()
        monkeypatch.setitem(GEMM_ROWS, "q4_0", x.shape[0] + 1)  # the q4_0 rows keep the block kernel
        mixed = layer(x)
        assert (mixed[:, :24] - want[:, :24]).abs().max().item() <= 1e-4 * want.abs().max().item()
        assert not torch.equal(mixed[:, 24:], want[:, 24:])
        assert (mixed[:, 24:] - want[:, 24:]).abs().max().item() <= 0.02 * want.abs().max().item()
