"""What the engine asks of GPT-NeoX before it builds it: config, tensors, KV caches, shards."""

import dataclasses

from neox_plugin.config import NeoXConfig
from rtpcore import ModelPlugin
from rtpcore.sharding import column_shard, head_shard, row_shard

LAYER = "gpt_neox.layers.{layer}."


class NeoXPlugin(ModelPlugin):
    model_type = "gpt_neox"
    architectures = ("GPTNeoXForCausalLM",)
    forward_contract = 2  # rtpcore.FORWARD_CONTRACT when this was written

    @classmethod
    def config_from_hf(cls, hf_config):
        return NeoXConfig.from_hf(hf_config)

    @classmethod
    def weight_patterns(cls, config):
        return list(cls.weight_shapes(config))

    @classmethod
    def weight_shapes(cls, config):
        e, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
        shapes = {
            "gpt_neox.embed_in.weight": (v, e),
            "gpt_neox.final_layer_norm.weight": (e,),
            "gpt_neox.final_layer_norm.bias": (e,),
            LAYER + "input_layernorm.weight": (e,),
            LAYER + "input_layernorm.bias": (e,),
            LAYER + "post_attention_layernorm.weight": (e,),
            LAYER + "post_attention_layernorm.bias": (e,),
            LAYER + "attention.query_key_value.weight": (3 * e, e),
            LAYER + "attention.dense.weight": (e, e),
            LAYER + "mlp.dense_h_to_4h.weight": (i, e),
            LAYER + "mlp.dense_h_to_4h.bias": (i,),
            LAYER + "mlp.dense_4h_to_h.weight": (e, i),
            LAYER + "mlp.dense_4h_to_h.bias": (e,),
        }
        if config.attention_bias:
            shapes[LAYER + "attention.query_key_value.bias"] = (3 * e,)
            shapes[LAYER + "attention.dense.bias"] = (e,)
        if not config.tie_word_embeddings:
            shapes["embed_out.weight"] = (v, e)
        return shapes

    @classmethod
    def kv_cache_descs(cls, config, *, kv_cache_dtype="fp32", tokens_per_block=16, **options):
        from rtpcore_native import KVCacheSpecDesc

        return [
            KVCacheSpecDesc(
                tag=f"layers.{i}",
                kind="mha",
                dtype=kv_cache_dtype,
                num_kv_heads=config.num_attention_heads,  # no grouped-query attention in GPT-NeoX
                head_dim=config.head_dim,
                tokens_per_block=tokens_per_block,
            )
            for i in range(config.num_hidden_layers)
        ]

    @classmethod
    def tensor_parallel_shard(cls, config, rank, world_size):
        heads, d, inter = config.num_attention_heads, config.head_dim, config.intermediate_size
        # query_key_value's rows are [q | k | v] per head, head after head: whole heads are
        # one contiguous block of 3 * head_dim rows each.
        qkv = head_shard(heads, 3 * d, rank, world_size)
        up = column_shard(inter, rank, world_size, name="intermediate_size")
        slices = {
            LAYER + "attention.query_key_value.weight": qkv.as_slice(),
            LAYER + "attention.query_key_value.bias": qkv.as_slice(),
            LAYER + "attention.dense.weight": head_shard(heads, d, rank, world_size, dim=1).as_slice(),
            LAYER + "mlp.dense_h_to_4h.weight": up.as_slice(),
            LAYER + "mlp.dense_h_to_4h.bias": up.as_slice(),
            LAYER + "mlp.dense_4h_to_h.weight": row_shard(inter, rank, world_size, name="intermediate_size").as_slice(),
        }
        if not config.tie_word_embeddings and config.vocab_size % world_size == 0:
            slices["embed_out.weight"] = column_shard(config.vocab_size, rank, world_size).as_slice()
        local = dataclasses.replace(config, num_attention_heads=heads // world_size, intermediate_size=up.size)
        return local, slices

    @classmethod
    def build_model(cls, config, weights, *, dtype=None, device=None, parallel=None, **options):
        from neox_plugin.model import NeoXModel

        return NeoXModel(config, weights, dtype=dtype, device=device, parallel=parallel)
