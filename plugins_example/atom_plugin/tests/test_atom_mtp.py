"""DeepSeek-V3's multi-token-prediction layer as the draft of ``draft_model="mtp"``.

Random weights do not agree, so the checks use oracle checkpoints built from the demo: a
target whose residual branches are zero (its next token depends on the last token only,
and its final hidden state at position p is the embedding of token p) and an MTP layer
whose block is zero too and whose ``eh_proj`` selects one input. Selecting the
embedding, the layer predicts what the target will (nearly every proposal accepted);
selecting the hidden state, it repeats the last token, and the number of accepted
proposals follows from the output alone -- a hidden state from the wrong row would make
the layer agree with the target instead.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rtpcore import Engine
from rtpcore.errors import MissingTensorsError
from rtpcore.testing import demo_checkpoint

PLUGINS = ("atom-plugin",)
PROMPTS = [[256, 72, 101, 108], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [256, 33], [256, 90, 91]]
MTP_LAYER = "model.layers.3."  # the demo has 3 decoder layers


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_checkpoint("deepseek_v3", plugins=list(PLUGINS), cache_dir=tmp_path_factory.mktemp("demo"))


def oracle(demo: Path, dest: Path, select: str) -> Path:
    """A copy of the demo with zero residual branches and an MTP layer reading only ``select``
    ("embedding" or "hidden") through ``eh_proj``."""
    shutil.copytree(demo, dest)
    tensors = load_file(str(demo / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(t)
    d = tensors["model.embed_tokens.weight"].shape[1]
    eye, zero = torch.eye(d), torch.zeros(d, d)
    tensors[MTP_LAYER + "eh_proj.weight"] = torch.cat((eye, zero) if select == "embedding" else (zero, eye), dim=1)
    tensors[MTP_LAYER + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def generate(path: Path, n: int, **kwargs: object) -> tuple[list[list[int]], object]:
    with Engine.from_pretrained(path, plugins=PLUGINS, tokens_per_block=4, **kwargs) as engine:
        out = engine.generate(PROMPTS, max_new_tokens=n, stop_token_ids=[])
        stats = engine.speculative_stats
    return out, stats


@pytest.mark.parametrize(("kv", "layout"), [("auto", None), ("fp8", "padded"), ("fp8", "compact")])
def test_mtp_on_random_weights_keeps_the_targets_greedy_output(demo: Path, kv: str, layout: str | None) -> None:
    """Every KV format: the draft's MLA layer is cached in the target's format and layout."""
    options = {"kv_cache_dtype": kv, "kv_layout": layout}
    reference, _ = generate(demo, 16, **options)
    with Engine.from_pretrained(
        demo, plugins=PLUGINS, tokens_per_block=4, draft_model="mtp", num_speculative_tokens=3, **options
    ) as engine:
        assert engine.generate(PROMPTS, max_new_tokens=16, stop_token_ids=[]) == reference
        assert engine.speculative_stats.proposed > 0
        assert engine.draft_kv_cache_specs[0].bytes_per_token == engine.kv_cache_specs[0].bytes_per_token


def test_mtp_reading_the_next_token_agrees_with_the_target(demo: Path, tmp_path: Path) -> None:
    path = oracle(demo, tmp_path / "ckpt", "embedding")
    plain, _ = generate(path, 20)
    out, stats = generate(path, 20, draft_model="mtp", num_speculative_tokens=3)
    assert out == plain
    assert stats.proposed > 0 and stats.accepted >= 0.9 * stats.proposed


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_reads_the_hidden_state_of_the_position_before_its_token(demo: Path, tmp_path: Path, k: int) -> None:
    """The layer then proposes the last token again, k times; a proposal is accepted while
    the target repeats the token too."""
    path = oracle(demo, tmp_path / "ckpt", "hidden")
    n = 20
    plain, _ = generate(path, n)
    out, stats = generate(path, n, draft_model="mtp", num_speculative_tokens=k)
    assert out == plain
    proposed = accepted = 0
    for gen in out:
        g = 1  # the first token comes from the prefill
        while g < n:
            run = min(k, n - g - 1)
            agree = 0
            while agree < run and gen[g + agree] == gen[g - 1]:
                agree += 1
            proposed, accepted, g = proposed + run, accepted + agree, g + (agree + 1 if run else 1)
    assert (stats.proposed, stats.accepted) == (proposed, accepted)
    assert accepted < proposed  # an MTP agreeing with the target would accept every proposal


def test_mtp_reads_only_its_own_tensors_in_addition(demo: Path) -> None:
    with safe_open(str(demo / "model.safetensors"), "pt") as f:
        mtp_bytes = sum(f.get_tensor(k).nbytes for k in f.keys() if k.startswith(MTP_LAYER))  # noqa: SIM118
    with Engine.from_pretrained(demo, plugins=PLUGINS) as engine:
        target_bytes = engine._group.local.bytes_read
    with Engine.from_pretrained(demo, plugins=PLUGINS, draft_model="mtp") as engine:
        shard = engine._group.local
        assert shard.target.bytes_read == target_bytes
        assert shard.draft.bytes_read == mtp_bytes > 0
        assert [s.tag for s in engine.draft_kv_cache_specs] == ["layers.3"]


def test_declared_mtp_layers_without_their_tensors_are_an_error(demo: Path, tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    shutil.copytree(demo, dest)
    tensors = {k: v for k, v in load_file(str(demo / "model.safetensors")).items() if not k.startswith(MTP_LAYER)}
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    with Engine.from_pretrained(dest, plugins=PLUGINS) as engine:  # the target alone does not need them
        assert engine.generate([[256, 1]], max_new_tokens=2)
    with pytest.raises(MissingTensorsError, match=r"model\.layers\.3\.eh_proj\.weight"):
        Engine.from_pretrained(dest, plugins=PLUGINS, draft_model="mtp")


def test_without_declared_mtp_layers_mtp_is_refused(demo: Path, tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    shutil.copytree(demo, dest)
    config = json.loads((dest / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (dest / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="offers no multi-token-prediction draft"):
        Engine.from_pretrained(dest, plugins=PLUGINS, draft_model="mtp")


def test_cli_generate_with_the_mtp_draft(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    base = [sys.executable, "-m", "rtpcore", "generate", "--demo", "deepseek_v3", "--plugins", "atom-plugin",
            "--prompt-ids", "256,72,105", "--max-new-tokens", "8", "--json"]
    plain = subprocess.run(base, capture_output=True, text=True, env=env, check=True)
    spec = subprocess.run([*base, "--draft-model", "mtp", "--num-speculative-tokens", "2"],
                          capture_output=True, text=True, env=env, check=True)
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 8
    assert b["speculative"]["draft_model"] == "mtp" and b["speculative"]["proposed"] > 0


@pytest.mark.slow
def test_tensor_parallel_ranks_each_build_their_part_of_the_mtp_draft(demo: Path) -> None:
    plain, _ = generate(demo, 12)
    with Engine.from_pretrained(
        demo, plugins=PLUGINS, tokens_per_block=4, draft_model="mtp", num_speculative_tokens=2, tensor_parallel_size=2
    ) as engine:
        assert engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[]) == plain
        ranks = engine._group.run("stats", None, gather=True)
        assert engine.speculative_stats.proposed > 0
    with Engine.from_pretrained(demo, plugins=PLUGINS, draft_model="mtp") as engine:
        whole = engine._group.run("stats")
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["elements"] < whole["elements"] for r in ranks)  # heads and experts split, MTP block too
