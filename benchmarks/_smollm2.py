"""SmolLM2-135M's shape (benchmarks/bench_decode.py's SMOLLM2_CONFIG), seeded random weights, with a
real SentencePiece tokenizer (``tokenizer.model``, trained here by ``sentencepiece`` on Python's own
sources) so that llama.cpp's ``convert_hf_to_gguf.py`` converts the checkpoint: the GGUF peers of
benchmarks/bench_gguf.py run the same weights and the same vocabulary as rtpcore.

    python benchmarks/_smollm2.py OUT_DIR     # writes OUT_DIR/smollm2-135m
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


def make_checkpoint(out: Path) -> Path:
    """The checkpoint folder (made once): config.json, model.safetensors, tokenizer.model."""
    import sentencepiece as spm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_decode import SMOLLM2_CONFIG

    path = out / "smollm2-135m"
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
    config = {**SMOLLM2_CONFIG, "bos_token_id": 1, "eos_token_id": 2}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).float().save_pretrained(path)
    # No tokenizer.json: the benchmarks prompt with token ids; the GGUF files carry the vocabulary
    # (tokenizer.ggml.*) from tokenizer.model, and rtpcore reads it from there.
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>",
                                                            "eos_token": "</s>", "unk_token": "<unk>"}))
    return path


if __name__ == "__main__":
    print(make_checkpoint(Path(sys.argv[1])))
