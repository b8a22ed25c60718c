"""GPT-NeoX's forward over rtpcore's paged KV cache (forward contract 2).

T is the step's new tokens (every sequence's, flat), E hidden_size, H this rank's heads,
D head_dim. Numerics follow transformers' GPTNeoXForCausalLM, so float32 greedy tokens match.
"""

import torch
import torch.nn.functional as F
from torch import nn

from rtpcore.layers import GatherColumns, Linear, paged_attention, row_parallel


def rotate(x, cos, sin, dims):
    """Rotary embedding on the first ``dims`` of each head (rotate-half, as transformers);
    x (T, H, D), cos/sin (T, 1, dims)."""
    rot, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + turned * sin, rest), dim=-1)


class LayerNorm(nn.Module):
    def __init__(self, w, name, eps):
        super().__init__()
        self.register_buffer("weight", w[name + ".weight"], persistent=False)  # (E,)
        self.register_buffer("bias", w[name + ".bias"], persistent=False)  # (E,)
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class NeoXLayer(nn.Module):
    def __init__(self, config, w, prefix, parallel):
        super().__init__()
        a, m = prefix + "attention.", prefix + "mlp."
        self.heads, self.head_dim, self.rotary_dim = config.num_attention_heads, config.head_dim, config.rotary_dim
        self.parallel_residual = config.use_parallel_residual
        self.ln1 = LayerNorm(w, prefix + "input_layernorm", config.layer_norm_eps)
        self.ln2 = LayerNorm(w, prefix + "post_attention_layernorm", config.layer_norm_eps)
        # Column-parallel: this rank's heads (E -> 3 H D) and its share of the MLP (E -> I/N).
        self.qkv = Linear(w[a + "query_key_value.weight"], w.get(a + "query_key_value.bias"))
        self.up = Linear(w[m + "dense_h_to_4h.weight"], w[m + "dense_h_to_4h.bias"])
        # Row-parallel: partial sums all-reduced, the bias added once (a plain Linear on one rank).
        self.dense = row_parallel(Linear, w[a + "dense.weight"], w.get(a + "dense.bias"), parallel)
        self.down = row_parallel(Linear, w[m + "dense_4h_to_h.weight"], w[m + "dense_4h_to_h.bias"], parallel)

    def attention(self, x, cos, sin, batch, cache, masks):
        t = x.shape[0]
        qkv = self.qkv(x).view(t, self.heads, 3 * self.head_dim)  # per head [q | k | v]
        q, k, v = qkv.split(self.head_dim, dim=-1)  # (T, H, D) each
        q, k = rotate(q, cos, sin, self.rotary_dim), rotate(k, cos, sin, self.rotary_dim)
        cache.write(batch.slots, k, v)  # this step's keys first: a prompt chunk attends to itself too
        out = paged_attention(q, cache, batch, scale=self.head_dim**-0.5, masks=masks)  # (T, H, D)
        return self.dense(out.reshape(t, -1))  # (T, E)

    def forward(self, x, cos, sin, batch, cache, masks):
        attn = self.attention(self.ln1(x), cos, sin, batch, cache, masks)
        if self.parallel_residual:  # x + attn(ln1(x)) + mlp(ln2(x)), summed in transformers' order
            return self.down(F.gelu(self.up(self.ln2(x)))) + attn + x
        x = attn + x
        return self.down(F.gelu(self.up(self.ln2(x)))) + x


class NeoXModel(nn.Module):
    """``model(batch, kv_caches)`` -> (N, vocab) logits of the rows ``batch.logits_index`` names."""

    def __init__(self, config, weights, *, dtype=None, device=None, parallel=None):
        super().__init__()
        w = {name: t.to(device=device, dtype=dtype or t.dtype) for name, t in weights.items()}
        self.register_buffer("embed", w["gpt_neox.embed_in.weight"], persistent=False)  # (V, E), on every rank
        self.final_ln = LayerNorm(w, "gpt_neox.final_layer_norm", config.layer_norm_eps)
        self.layers = nn.ModuleList(
            NeoXLayer(config, w, f"gpt_neox.layers.{i}.", parallel) for i in range(config.num_hidden_layers)
        )
        head = w["gpt_neox.embed_in.weight" if config.tie_word_embeddings else "embed_out.weight"]
        self.head = Linear(head)
        if head.shape[0] != config.vocab_size:  # split by vocabulary across ranks: gather it
            self.head = GatherColumns(self.head, parallel)
        d = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # (d / 2,)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, batch, kv_caches):
        x = F.embedding(batch.input_ids, self.embed)  # (T, E)
        freqs = batch.positions[:, None].float() * self.inv_freq  # (T, rotary_dim / 2), in float32
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (T, 1, rotary_dim)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        masks = {}  # the step's attention masks, built once and shared by the layers
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, batch, cache, masks)
        if batch.logits_index is not None:
            x = x[batch.logits_index]  # only the rows that sample: (N, E)
        return self.head(self.final_ln(x))  # (N, V)
