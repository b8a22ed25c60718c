"""Tensor-parallel engines: N=2 worker processes give N=1's greedy tokens (float32, batched)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from _tp_toys import run_env_ranks
from rtpcore import Engine
from rtpcore.errors import RtpcoreError, ShardingError, WorkerError
from test_llama import hf_greedy, make_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 33, 7, 81], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100]]
NEW_TOKENS = 24


def _generate(path: Path, n: int) -> tuple[list[list[int]], list[dict]]:
    with Engine.from_pretrained(path, tokens_per_block=4, tensor_parallel_size=n) as engine:
        outs = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        stats = engine._group.run("stats", None, gather=True)
    return outs, stats


@pytest.mark.parametrize(
    ("variant", "overrides"),
    [
        # KV heads split 2 -> 1 per rank; lm_head split by vocabulary
        ("llama-gqa", {}),
        # one KV head, replicated on both ranks; o_proj/down_proj biases added once
        ("llama-bias", {"num_key_value_heads": 1}),
        # tied embeddings: lm_head replicated
        ("llama-tied", {}),
    ],
)
def test_two_ranks_generate_the_tokens_of_one_rank_and_of_transformers(
    tmp_path, variant, overrides
):
    """Batched greedy float32 output with N=2 equals N=1's and transformers'; each rank
    reads and holds less than the whole model."""
    hf = make_checkpoint(tmp_path, variant, **overrides)
    one, (whole,) = _generate(tmp_path, 1)
    two, stats = _generate(tmp_path, 2)
    assert two == one
    assert one == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert [s["rank"] for s in stats] == [0, 1]
    # Each rank read (and holds) only its part of the sharded tensors.
    assert all(s["bytes_read"] < whole["bytes_read"] for s in stats)
    assert all(s["elements"] < whole["elements"] for s in stats)


def test_heads_that_do_not_divide_fail_the_build_naming_the_size_and_the_rule(tmp_path):
    """4 heads over 3 ranks is a ShardingError, raised by from_pretrained."""
    make_checkpoint(
        tmp_path, "llama-gqa", num_attention_heads=4, num_key_value_heads=1, hidden_size=48
    )
    with pytest.raises(
        ShardingError, match=r"num_attention_heads=4 cannot be split across tensor_parallel_size=3"
    ):
        Engine.from_pretrained(tmp_path, tensor_parallel_size=3)


def test_a_killed_worker_fails_generate_naming_its_rank(tmp_path):
    """A worker killed between calls makes the next generate raise WorkerError at once."""
    make_checkpoint(tmp_path, "llama-gqa")
    engine = Engine.from_pretrained(tmp_path, tokens_per_block=4, tensor_parallel_size=2)
    os.kill(engine._group.pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match="rank 1 was killed by signal SIGKILL"):
        engine.generate(PROMPTS, max_new_tokens=4)
    engine.close()


RANK0_SCRIPT = """
import json, sys
from rtpcore import Engine
with Engine.from_pretrained(sys.argv[1], tokens_per_block=4, tensor_parallel_size=2) as engine:
    print(json.dumps(engine.generate(json.loads(sys.argv[2]), max_new_tokens=8, stop_token_ids=[])))
"""


def test_an_engine_spans_two_nodes_over_env_rendezvous(tmp_path):
    """Rank 0 builds the engine in its script; rank 1 runs `python -m rtpcore.parallel.leader`,
    receives the config (with the plugin plan) from rank 0 and builds its shard."""
    make_checkpoint(tmp_path, "llama-gqa")
    with Engine.from_pretrained(tmp_path, tokens_per_block=4) as engine:
        expected = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    commands = (
        [sys.executable, "-c", RANK0_SCRIPT, str(tmp_path), json.dumps(PROMPTS)],
        [sys.executable, "-m", "rtpcore.parallel.leader"],
    )
    (code0, out0, err0), (code1, _, err1) = run_env_ranks(commands)
    assert (code0, code1) == (0, 0), err0 + err1
    assert json.loads(out0) == expected


NO_TP_PLUGIN = """
from rtpcore import hookimpl
from rtpcore.models.llama import LlamaPlugin

class NoTp(LlamaPlugin):
    model_type = "no_tp"
    architectures = ("NoTpForCausalLM",)
    tensor_parallel_shard = None  # a model that cannot be split

@hookimpl
def rtpcore_register_models(registry):
    registry.register(NoTp)
"""


def test_a_model_without_tensor_parallel_support_is_a_clear_error(tmp_path, plugin_env):
    """A plugin without tensor_parallel_shard refuses tensor_parallel_size=2 by name."""
    make_checkpoint(tmp_path, "llama-gqa")
    plugin_env.add_module("wk_no_tp.py", NO_TP_PLUGIN)
    with pytest.raises(
        RtpcoreError, match=r"model type 'no_tp' .* does not support tensor_parallel_size=2"
    ):
        Engine.from_pretrained(
            tmp_path,
            external_model_packages=["wk_no_tp"],
            model_type="no_tp",
            tensor_parallel_size=2,
        )


DEEPSEEK_TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
    max_position_embeddings=256,
)  # fmt: skip


def test_atom_plugin_deepseek_v3_on_two_ranks_generates_the_tokens_of_one_rank(tmp_path):
    """The external DeepSeek-V3 (MLA, MoE) through the engine: N=2 equals N=1, batched."""
    pytest.importorskip("atom_plugin")
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**DEEPSEEK_TINY, initializer_range=0.2)
    model = transformers.DeepseekV3ForCausalLM(config)  # large weights: varied tokens
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    outs = []
    for n in (1, 2):
        with Engine.from_pretrained(
            tmp_path, plugins=("atom-plugin",), tokens_per_block=4, tensor_parallel_size=n
        ) as engine:
            outs.append(engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[]))
    assert outs[1] == outs[0]
    assert all(len(set(tokens)) > 4 for tokens in outs[0])  # not a degenerate repetition
