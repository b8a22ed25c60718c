"""The kit's engine checks (docs/design.md §19): each is ok or skips with its reason on the
built-in Llama, and a model whose forward depends on the batch composition fails them, naming
the prompt, the first differing new token and both tokens."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from plugin_env import PluginEnv
from rtpcore.testing.kit import RULES, CheckResult, plan_checks

#: What each engine check reports on the built-in Llama on the CPU: status, and a piece of its detail.
LLAMA = {
    "batch_invariance": ("ok", "4 prompts, 12 new tokens each"),
    "chunked_prefill_invariance": ("ok", "mixed prefill/decode steps"),
    "prefix_cache_invariance": ("ok", "prompt tokens served from the cache"),
    "preemption_invariance": ("ok", "preemptions in a pool of"),
    "draft": ("skip", "LlamaPlugin offers no draft (mtp_draft returns None)"),
    "hf_parity": ("ok", "3 prompts, 16 new tokens each"),
    "graph_replay": ("skip", "needs a CUDA device; running on cpu"),
}

# A Llama whose logits rows each get the mean of every row of the step: right alone, wrong in a batch.
BATCH_MIXING = textwrap.dedent(
    """
    from rtpcore import hookimpl
    from rtpcore.models.llama import LlamaPlugin


    class BatchMixingLlama(LlamaPlugin):
        model_type = "batch_mixing_llama"
        architectures = ("BatchMixingLlamaForCausalLM",)
        transformers_class = None
        tensor_parallel_shard = None

        @classmethod
        def build_model(cls, config, weights, **options):
            model = super().build_model(config, weights, **options)
            forward = model.forward

            def mixed(batch, kv_caches):
                logits = forward(batch, kv_caches)  # (N, vocab)
                return logits + logits.mean(dim=0, keepdim=True)

            model.forward = mixed
            return model


    @hookimpl
    def rtpcore_register_models(registry):
        registry.register(BatchMixingLlama)
    """
)


@pytest.fixture(scope="module")
def kit_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoints of this module's kit runs."""
    return tmp_path_factory.mktemp("kit-demo")


def _run(item: str, check: str, cache: Path) -> CheckResult:
    (planned,) = plan_checks(item, checks=[check], cache_dir=cache)
    return planned.run()


@pytest.mark.parametrize("check", list(LLAMA))
def test_each_engine_check_passes_or_skips_with_its_reason_on_llama(check: str, kit_cache: Path) -> None:
    """Llama's greedy output is its own alone, batched, chunked, cached, preempted, and is
    transformers'; it has no draft, and graph replay needs a GPU."""
    if check == "hf_parity":
        pytest.importorskip("transformers")
    result = _run("rtpcore.models", check, kit_cache)
    status, detail = LLAMA[check]
    assert (result.check, result.subject, result.status) == (check, "llama", status), result.detail
    assert detail in result.detail


@pytest.mark.slow
def test_tensor_parallel_on_two_gloo_ranks_passes_on_llama(kit_cache: Path) -> None:
    """Two CPU ranks give the tokens of one."""
    result = _run("rtpcore.models", "tensor_parallel", kit_cache)
    assert result.status == "ok", result.detail
    assert "3 prompts batched" in result.detail


def _install_batch_mixing(plugin_env: PluginEnv) -> str:
    plugin_env.add_dist(
        "batch-mixing-llama",
        plugins={"batch_mixing": "batch_mixing_llama"},
        architectures={"BatchMixingLlamaForCausalLM": "batch_mixing"},
        modules={"batch_mixing_llama.py": BATCH_MIXING},
    )
    return "batch-mixing-llama"


@pytest.mark.parametrize(("check", "other", "setting"), [("batch_invariance", "batched", ""),
                                                         ("chunked_prefill_invariance", "chunked",
                                                          ", max_num_batched_tokens=7")])
def test_a_forward_that_mixes_the_batch_fails_naming_the_first_differing_token(
    plugin_env: PluginEnv, tmp_path: Path, check: str, other: str, setting: str
) -> None:
    """The rule, then the prompt, the index of the first new token where the batched output left
    the prompt's own, and both tokens (which differ), then both outputs."""
    item = _install_batch_mixing(plugin_env)
    result = _run(item, check, tmp_path / "demo")
    assert (result.subject, result.status) == ("batch_mixing_llama", "FAIL"), result.detail
    rule, seen = result.detail.split("\n", 1)
    assert rule == f"rule: {RULES[check]}"
    found = re.match(rf"prompt (\d) \((\d+) tokens\){setting}: {other} output left the alone output at new token (\d+): "
                     rf"alone (\d+), {other} (\d+) \(", seen)
    assert found, seen
    index, alone, batched = int(found[3]), int(found[4]), int(found[5])
    assert alone != batched
    (printed,) = re.findall(r"^  alone: (\[.*\])$", seen, flags=re.M)  # the prompt's own output, whole
    assert json.loads(printed)[index] == alone


def test_checks_a_model_does_not_apply_to_skip_with_the_reason(plugin_env: PluginEnv, tmp_path: Path) -> None:
    """No tensor_parallel_shard, no transformers class, no draft: three skips, each saying what is missing."""
    item = _install_batch_mixing(plugin_env)
    results = {c: _run(item, c, tmp_path / "demo") for c in ("tensor_parallel", "hf_parity", "draft")}
    assert {c: r.status for c, r in results.items()} == dict.fromkeys(results, "skip")
    assert results["tensor_parallel"].detail == ("BatchMixingLlama does not implement tensor_parallel_shard(): "
                                                 "it runs on one rank only")
    assert results["hf_parity"].detail == ("BatchMixingLlama names no transformers class "
                                           "(ModelPlugin.transformers_class)")
    assert results["draft"].detail == "BatchMixingLlama offers no draft (mtp_draft returns None)"


def test_a_difference_at_a_near_tie_of_the_reference_is_noted_and_any_other_fails() -> None:
    """Tokens whose reference log-probabilities are within 1e-4 (relative) may flip: the rest of
    that prompt is not compared and the ok note says so; a clear winner that differs fails."""
    from rtpcore.testing._checks_engine import _compare, _Reference
    from rtpcore.testing.kit import CheckFailed

    tie = _Reference((7, 8, 9), ({7: -1.0}, {8: -2.0, 3: -2.0001}, {9: -0.5}))
    note = _compare("batch_invariance", [[1, 2]], [tie], [[7, 3, 5]], reference="alone", other="batched",
                    done="1 prompt")
    assert note == "1 prompt; prompt 0: new tokens from 1 on not compared (near-tie 8 / 3, log-probabilities 1.0e-04 apart)"
    clear = _Reference((7, 8, 9), ({7: -1.0}, {8: -2.0, 3: -2.5}, {9: -0.5}))
    with pytest.raises(CheckFailed) as excinfo:
        _compare("batch_invariance", [[1, 2]], [clear], [[7, 3, 9]], reference="alone", other="batched", done="")
    assert excinfo.value.seen.startswith("prompt 0 (2 tokens): batched output left the alone output at new token 1: "
                                         "alone 8, batched 3 (alone's log-probabilities -2 and -2.5)")
