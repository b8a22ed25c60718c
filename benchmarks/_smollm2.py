"""SmolLM2-135M's shape (benchmarks/bench_decode.py's SMOLLM2_CONFIG), seeded random weights, with a
real SentencePiece tokenizer (``tokenizer.model``, trained here by ``sentencepiece`` on Python's own
sources) so that llama.cpp's ``convert_hf_to_gguf.py`` converts the checkpoint: the GGUF peers of
benchmarks/bench_gguf.py run the same weights and the same vocabulary as rtpcore.

    python benchmarks/_smollm2.py OUT_DIR [llama-1024x16]    # writes OUT_DIR/smollm2-135m (or the other)

``llama-1024x16`` is a random-weight Llama whose widths are multiples of 256 (hidden 1024, 16
layers, intermediate 2816, 16 heads, 4 KV heads of 64), so llama.cpp's Q4_K_M file holds Q4_K
and Q6_K tensors throughout, where SmolLM2's width 576 makes it fall back to Q5_0 / Q8_0.
"""

from __future__ import annotations

import io
import json
import sys
import sysconfig
from pathlib import Path

SP_VOCAB = 8000  # trained pieces; the converter pads the vocabulary to vocab_size with [PAD<i>] tokens


def _corpus(limit: int = 4_000_000) -> str:
    """Text to train on: Python's standard library sources (always on the machine)."""
    out, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        out.append(text)
        size += len(text)
        if size > limit:
            break
    return "\n".join(out)


#: Other shapes than SmolLM2's, by checkpoint folder name.
SHAPES = {
    "llama-1024x16": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0,
                          tie_word_embeddings=False, rms_norm_eps=1e-5, hidden_act="silu"),
}


def make_checkpoint(out: Path, name: str = "smollm2-135m") -> Path:
    """The checkpoint folder (made once): config.json, model.safetensors, tokenizer.model."""
    import sentencepiece as spm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_decode import SMOLLM2_CONFIG

    path = out / name
    if (path / "model.safetensors").is_file() and (path / "tokenizer.model").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus().splitlines()), model_writer=model, vocab_size=SP_VOCAB, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0,
        max_sentence_length=8192, num_threads=2, minloglevel=2,
    )
    (path / "tokenizer.model").write_bytes(model.getvalue())
    config = {**SHAPES.get(name, SMOLLM2_CONFIG), "bos_token_id": 1, "eos_token_id": 2}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).float().save_pretrained(path)
    # No tokenizer.json: the benchmarks prompt with token ids; the GGUF files carry the vocabulary
    # (tokenizer.ggml.*) from tokenizer.model, and rtpcore reads it from there.
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>",
                                                            "eos_token": "</s>", "unk_token": "<unk>"}))
    return path


if __name__ == "__main__":
    print(make_checkpoint(Path(sys.argv[1]), *sys.argv[2:3]))
