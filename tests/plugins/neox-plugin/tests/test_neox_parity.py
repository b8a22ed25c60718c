"""neox-plugin against transformers: rtpcore's greedy tokens are transformers' own.

Run as a script with a folder, it writes the tiny checkpoint there, to try the CLI on.
"""

import sys
from pathlib import Path

import pytest
import torch
import transformers

from rtpcore import Engine

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5,
)  # fmt: skip
PROMPTS = [[5, 9, 33, 7, 81], list(range(1, 15)), [100]]
NEW_TOKENS = 16


def make_checkpoint(path, seed=0, **overrides):
    """A seeded random GPTNeoXForCausalLM saved to ``path`` (safetensors, float32)."""
    torch.manual_seed(seed)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**TINY, **overrides)).eval()
    with torch.no_grad():  # weights far from transformers' tiny init, so greedy output varies
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 2.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("parallel_residual", [True, False])
@pytest.mark.parametrize("ranks", [1, 2])
def test_greedy_tokens_equal_transformers(tmp_path, ranks, parallel_residual):
    """Ragged prompts batched together, float32, on one rank and on two (heads split)."""
    hf = make_checkpoint(tmp_path, use_parallel_residual=parallel_residual)
    with Engine.from_pretrained(tmp_path, plugins=("neox-plugin",), tensor_parallel_size=ranks,
                                max_num_batched_tokens=8) as engine:  # 8: the long prompt is prefilled in chunks
        got = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert all(len(set(tokens)) > 4 for tokens in got)  # not a degenerate repetition


if __name__ == "__main__":
    make_checkpoint(Path(sys.argv[1]))
