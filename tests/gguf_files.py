"""GGUF files for the tests, written from tiny transformers checkpoints the way llama.cpp's
``convert_hf_to_gguf.py`` writes them (with the ``gguf`` package's ``GGUFWriter``): the
``<arch>.*`` hyper-parameters, tensors renamed (``blk.N.attn_q.weight``, Qwen3's
``blk.N.attn_q_norm.weight``), Q and K rows permuted for the ``llama`` architecture (``LlamaModel.permute``), norms and biases kept in
F32, 2-D weights in the file type asked for, and the tokenizer as ``tokenizer.ggml.*`` keys
(byte-level BPE as ``gpt2``, a SentencePiece-style BPE as ``llama`` with its scores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3"}
FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32, "Q4_0": 2, "Q5_0": 8, "Q5_1": 9}

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")  # model.layers.N.<rest>
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:])]}"


def write_gguf(
    checkpoint: Path,
    out: Path,
    *,
    file_type: str = "F32",
    tokenizer: Any = None,
    vocab: str = "gpt2",
    pre: str = "gpt-2",
    chat_template: str | None = None,
    bos: str | None = None,
    eos: str | None = None,
    add_bos: bool | None = None,
    split_max_tensors: int = 0,
    skip: tuple[str, ...] = (),
    extra: dict[str, Any] | None = None,
) -> Path:
    """Convert the safetensors ``checkpoint`` (config.json + model.safetensors) and
    ``tokenizer`` (a ``tokenizers.Tokenizer``; ``vocab`` "gpt2" or "llama") into ``out``.
    ``skip`` leaves metadata keys or tensors (GGUF names) out; ``extra`` adds keys. With
    ``split_max_tensors`` the writer splits the file into ``out``'s ``-0000i-of-0000n`` parts.
    Returns ``out`` (the first part's path for a split set)."""
    import gguf
    from safetensors.numpy import load_file

    hf = json.loads((checkpoint / "config.json").read_text())
    arch = ARCHS[hf["architectures"][0]]
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    keys: dict[str, Any] = {
        f"{arch}.context_length": ("uint32", hf["max_position_embeddings"]),
        f"{arch}.embedding_length": ("uint32", hf["hidden_size"]),
        f"{arch}.block_count": ("uint32", hf["num_hidden_layers"]),
        f"{arch}.feed_forward_length": ("uint32", hf["intermediate_size"]),
        f"{arch}.attention.head_count": ("uint32", heads),
        f"{arch}.attention.head_count_kv": ("uint32", kv_heads),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", hf["rms_norm_eps"]),
        f"{arch}.rope.freq_base": ("float32", hf.get("rope_theta", 10000.0)),
        f"{arch}.rope.dimension_count": ("uint32", head_dim),
        f"{arch}.vocab_size": ("uint32", hf["vocab_size"]),
        "general.name": ("string", "tiny"),
        "general.file_type": ("uint32", FILE_TYPES[file_type]),
    }
    if hf.get("sliding_window") and arch == "llama":  # Mistral's window (a file without it loses the window)
        keys[f"{arch}.attention.sliding_window"] = ("uint32", hf["sliding_window"])
    if hf.get("head_dim"):
        keys[f"{arch}.attention.key_length"] = ("uint32", head_dim)
        keys[f"{arch}.attention.value_length"] = ("uint32", head_dim)
    if tokenizer is not None:
        keys.update(_tokenizer_keys(tokenizer, vocab, pre, bos, eos, add_bos))
    if chat_template is not None:
        keys["tokenizer.chat_template"] = ("string", chat_template)
    keys.update(extra or {})
    for key, (kind, value) in keys.items():
        if key not in skip:
            getattr(writer, f"add_{kind}")(key, value)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    for name, w in tensors.items():
        target = gguf_name(name)
        if target in skip:
            continue
        w = w.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute(w, heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute(w, kv_heads)
        if w.ndim == 1 or file_type == "F32":
            writer.add_tensor(target, w)
        elif file_type == "F16":
            writer.add_tensor(target, w.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[file_type]
            writer.add_tensor(target, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        parts = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
        return parts[0] if parts else out
    return out


def _tokenizer_keys(tok: Any, vocab: str, pre: str, bos: str | None, eos: str | None,
                    add_bos: bool | None) -> dict[str, Any]:
    """``tokenizer.ggml.*`` as the converter writes them from a ``tokenizer.json``."""
    data = json.loads(tok.to_str())
    n = tok.get_vocab_size(with_added_tokens=True)
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = {a["id"]: a for a in data.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(n):
        text = by_id.get(i, f"[PAD{i}]")
        tokens.append(text)
        if i in added:
            types.append(3 if added[i]["special"] else 4)  # CONTROL, USER_DEFINED
        elif vocab == "llama" and text.startswith("<0x") and len(text) == 6:
            types.append(6)  # BYTE
        else:
            types.append(1)  # NORMAL
    keys: dict[str, Any] = {
        "tokenizer.ggml.model": ("string", vocab),
        "tokenizer.ggml.tokens": ("array", tokens),
        "tokenizer.ggml.token_type": ("array", types),
    }
    if vocab == "gpt2":
        merges = data["model"]["merges"]
        keys["tokenizer.ggml.pre"] = ("string", pre)
        keys["tokenizer.ggml.merges"] = ("array", [m if isinstance(m, str) else " ".join(m) for m in merges])
    else:  # SentencePiece BPE: a piece made by a later merge has a lower score
        keys["tokenizer.ggml.scores"] = ("array", [-float(i) for i in range(n)])
        keys["tokenizer.ggml.unknown_token_id"] = ("uint32", tok.token_to_id("<unk>"))
    if bos is not None:
        keys["tokenizer.ggml.bos_token_id"] = ("uint32", tok.token_to_id(bos))
    if eos is not None:
        keys["tokenizer.ggml.eos_token_id"] = ("uint32", tok.token_to_id(eos))
    if add_bos is not None:
        keys["tokenizer.ggml.add_bos_token"] = ("bool", add_bos)
    return keys
