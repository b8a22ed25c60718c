"""A GGUF file's hyper-parameters as a Hugging Face ``config.json`` dict, and its tensor names.

llama.cpp's converter writes a model's ``config.json`` as ``<arch>.*`` metadata keys
(``llama.embedding_length``, ``qwen2.attention.head_count_kv``, ...) and renames its tensors
(``model.layers.0.self_attn.q_proj.weight`` -> ``blk.0.attn_q.weight``). This module undoes
both for the Llama family (:data:`LLAMA_FAMILY`: ``llama``, which llama.cpp also writes for
Mistral, ``mistral``, ``qwen2``, ``qwen3``), so that a model plugin reads a GGUF checkpoint
through the same ``config_from_hf`` and ``weight_patterns`` as the safetensors one:

    hf = llama_family_config(checkpoint)        # {"architectures": ["LlamaForCausalLM"], ...}
    names = llama_family_tensor_names(hf, checkpoint.architecture)
    # {"blk.0.attn_q.weight": GGUFTensorName("model.layers.0.self_attn.q_proj.weight", permuted_heads=4), ...}

For the ``llama`` (and ``mistral``) architecture the converter permuted the rows of Q and K
(``LlamaModel.permute``: within each head, the interleaved rotary pairs of Meta's layout
instead of Hugging Face's two halves); :class:`GGUFTensorName` records it, and the loader
undoes it on whole rows, so that the loaded model equals the original.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import frozen

from rtpcore.checkpoint.gguf.reader import GGUFCheckpoint, _fail

__all__ = [
    "LLAMA_FAMILY",
    "GGUFTensorName",
    "llama_family_config",
    "llama_family_tensor_names",
    "torch_dtype_of",
]

#: GGUF ``general.architecture`` -> (Hugging Face architecture, model_type) of the Llama family.
LLAMA_FAMILY: Mapping[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_PERMUTED = frozenset({"llama", "mistral"})  # llama.cpp's LlamaModel and its subclasses permute Q and K

# general.file_type (llama_ftype) -> the torch dtype the file's float weights are in.
_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


@frozen
class GGUFTensorName:
    """Where a GGUF tensor goes: ``name``, the checkpoint name a model's weight patterns use
    (``model.layers.0.self_attn.q_proj.weight``), and ``permuted_heads``: the number of heads
    whose rows llama.cpp's converter permuted (Q: the query heads, K: the KV heads; None: as
    stored). A row permutation moves whole rows, so it applies to quantized blocks as well."""

    name: str
    permuted_heads: int | None = None


def torch_dtype_of(checkpoint: GGUFCheckpoint) -> str | None:
    """The torch dtype of a float file (``general.file_type`` F32, F16, BF16), else None."""
    kind = checkpoint.get("general.file_type", None, int)
    return _FILE_TYPES.get(kind) if isinstance(kind, int) else None


def llama_family_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    """The ``config.json`` dict of a Llama-family GGUF checkpoint. Hyper-parameters come from
    the ``<arch>.*`` keys (required ones missing are a CheckpointError naming the file and the
    key), the vocabulary size from ``token_embd.weight``, ``tie_word_embeddings`` from the
    absence of ``output.weight``, BOS/EOS from ``tokenizer.ggml.*`` (EOT and EOM join EOS: the
    tokens llama.cpp ends a generation at)."""
    arch = checkpoint.architecture
    if arch not in LLAMA_FAMILY:
        raise _fail(
            checkpoint.files[0],
            f"general.architecture {arch!r} is not a Llama-family architecture ({', '.join(LLAMA_FAMILY)})",
            "general.architecture",
        )
    hf_arch, model_type = LLAMA_FAMILY[arch]

    def need(key: str, kind: type = int) -> Any:
        return checkpoint.require(f"{arch}.{key}", kind)

    def opt(key: str, kind: type = int) -> Any:
        return checkpoint.get(f"{arch}.{key}", None, kind)

    hidden, heads = need("embedding_length"), need("attention.head_count")
    if "rope_freqs.weight" in checkpoint.tensors:
        raise _fail(
            checkpoint.path,
            "tensor 'rope_freqs.weight' (per-frequency RoPE factors, Llama 3.1-style scaling) is not supported yet",
            "rope_freqs.weight",
        )
    embed = checkpoint.tensor("token_embd.weight")
    hf: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _feed_forward(checkpoint, arch),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": opt("attention.head_count_kv") or heads,
        "head_dim": opt("attention.key_length") or hidden // heads,
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon", float),
        "rope_theta": opt("rope.freq_base", float) or 10000.0,
        "max_position_embeddings": opt("context_length") or 2048,
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": "output.weight" not in checkpoint.tensors,
        "hidden_act": "silu",
    }
    rope = _rope_scaling(checkpoint, arch)
    if rope is not None:
        hf["rope_scaling"] = rope
    window = opt("attention.sliding_window")
    if window:
        hf["sliding_window"] = window
    if arch == "qwen2":
        hf["use_sliding_window"] = False
    for name, key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        value = checkpoint.get(f"tokenizer.ggml.{key}", None, int)
        if value is not None:
            hf[name] = value
    eos = [checkpoint.get(f"tokenizer.ggml.{k}_token_id", None, int) for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(e for e in eos if e is not None))
    if eos:
        hf["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    dtype = torch_dtype_of(checkpoint)
    if dtype is not None:
        hf["torch_dtype"] = dtype
    return hf


def _feed_forward(checkpoint: GGUFCheckpoint, arch: str) -> int:
    value = checkpoint.require(f"{arch}.feed_forward_length", (int, list))
    if isinstance(value, list):  # one per layer: the Llama family has one width
        if not value or len(set(value)) != 1:
            raise _fail(checkpoint.files[0], f"{arch}.feed_forward_length varies by layer ({value[:4]!r}...): "
                        "not a Llama-family model", f"{arch}.feed_forward_length")
        return int(value[0])
    return int(value)


def _rope_scaling(checkpoint: GGUFCheckpoint, arch: str) -> dict[str, Any] | None:
    """``rope_scaling`` from ``<arch>.rope.scaling.*`` (None: none, or type "none")."""
    kind = checkpoint.get(f"{arch}.rope.scaling.type", None, str)
    factor = checkpoint.get(f"{arch}.rope.scaling.factor", None, float)
    if kind in (None, "none") and not factor:
        return None
    rope: dict[str, Any] = {"rope_type": kind or "linear"}
    if factor:
        rope["factor"] = float(factor)
    original = checkpoint.get(f"{arch}.rope.scaling.original_context_length", None, int)
    if original:
        rope["original_max_position_embeddings"] = original
    return rope


# GGUF name (with "{i}" for the layer) -> Hugging Face name, as llama.cpp's tensor map has them.
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}


def llama_family_tensor_names(hf_config: Mapping[str, Any], architecture: str) -> dict[str, str | GGUFTensorName]:
    """GGUF name -> checkpoint name of every tensor a Llama-family GGUF file may hold, for
    ``hf_config``'s layer count; Q and K (weights and biases) of the ``llama`` and ``mistral``
    architectures carry their permutation (:class:`GGUFTensorName`)."""
    layers = int(hf_config["num_hidden_layers"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    permuted = architecture in _PERMUTED
    names: dict[str, str | GGUFTensorName] = dict(_GLOBAL)
    for i in range(layers):
        for gguf_name, hf_name in _LAYER.items():
            target = f"model.layers.{i}.{hf_name}"
            if permuted and gguf_name.startswith(("attn_q.", "attn_k.")):
                names[f"blk.{i}.{gguf_name}"] = GGUFTensorName(target, heads if "attn_q." in gguf_name else kv_heads)
            else:
                names[f"blk.{i}.{gguf_name}"] = target
    return names
