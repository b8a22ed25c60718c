"""The attention-backend seam (docs/design.md §18): the engine's per-layer choice among the
built-ins (``native_cpu``, ``torch``) and plugin backends registered through the
``rtpcore_register_attention_backends`` hook of a real distribution, chosen by name
(``attention_backend=`` / ``--attention-backend``) or by priority, counted in
``EngineStats.attention_calls``; a plugin backend equal to the reference token for token, on one
rank and on two (gloo); atom-plugin's ``atom_mla`` equal to the reference MLA; every wrong use
refused naming the plugin, the seam and the rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_env import PluginEnv
from rtpcore import Allowlist, Engine, load_plugins
from rtpcore.attention import (
    NativeCpuAttentionBackend,
    TorchAttentionBackend,
    choose_attention_backends,
)
from rtpcore.errors import (
    AttentionBackendError,
    PluginConflictError,
    PluginIncompatibleError,
    PluginLoadError,
)

pytest.importorskip("transformers")

PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [100], [7, 7]]

# A plugin backend: the reference, counted in a file named by the environment (so a spawned
# process's calls are seen too) and in the class.
COUNTING = '''
import os
from rtpcore import hookimpl
from rtpcore.attention import TorchAttentionBackend


class CountingBackend(TorchAttentionBackend):
    name = {name!r}
    priority = {priority}
    replaces = {replaces!r}
    calls = 0

    def attention(self, q, cache, batch, **kw):
        type(self).calls += 1
        path = os.environ.get("AB_COUNT_FILE")
        if path:
            with open(path, "a") as f:
                f.write("x")
        return super().attention(q, cache, batch, **kw)


@hookimpl
def rtpcore_register_attention_backends(registry):
    registry.register_attention_backend(CountingBackend)
'''


def counting_dist(env: PluginEnv, dist: str, *, name: str = "counting", priority: int = 0,
                  replaces: tuple[str, ...] = ()) -> str:
    module = dist.replace("-", "_")
    env.add_dist(dist, plugins={module: module},
                 modules={f"{module}.py": COUNTING.format(name=name, priority=priority, replaces=replaces)})
    return module


def greedy(engine: Engine) -> list[list[int]]:
    return engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[list[int]]:
    with Engine.from_pretrained(ckpt, tokens_per_block=4, attention_backend="torch") as engine:
        out = greedy(engine)
        calls = engine.stats().attention_calls
    assert set(calls) == {"torch"} and calls["torch"] > 0
    return out


def test_the_engine_picks_native_cpu_where_it_serves_and_the_reference_elsewhere(
    ckpt: Path, reference: list[list[int]]
) -> None:
    """float32 pools on the CPU: native_cpu (the native decode step); fp8 pools: torch, which
    every layer then calls. Calls are counted per backend, one per layer per forward."""
    with Engine.from_pretrained(ckpt, tokens_per_block=4) as engine:
        assert {type(c.attention_backend) for c in engine.kv_caches} == {NativeCpuAttentionBackend}
        assert greedy(engine) == reference  # greedy tokens: native decode within float32 rounding
        stats = engine.stats()
        layers = len(engine.kv_caches)
        assert set(stats.attention_calls) == {"native_cpu"}
        assert stats.attention_calls["native_cpu"] == layers * stats.steps_total
        assert engine.model.decode_kernel == "native"
    with Engine.from_pretrained(ckpt, tokens_per_block=4, kv_cache_dtype="fp8") as engine:
        assert {type(c.attention_backend) for c in engine.kv_caches} == {TorchAttentionBackend}
        greedy(engine)
        assert set(engine.stats().attention_calls) == {"torch"}


def test_a_plugin_backend_is_chosen_by_name_or_priority_and_matches_the_reference(
    plugin_env: PluginEnv, ckpt: Path, reference: list[list[int]]
) -> None:
    counting_dist(plugin_env, "ab-count", priority=50)
    from ab_count import CountingBackend  # type: ignore[import-not-found]

    with Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["ab-count"]) as engine:  # by priority
        assert {c.attention_backend.name for c in engine.kv_caches} == {"counting"}
        assert greedy(engine) == reference
        stats, layers = engine.stats(), len(engine.kv_caches)
        assert stats.attention_calls == {"counting": layers * stats.steps_total} and stats.steps_total > 0
        assert CountingBackend.calls == layers * (stats.steps_total + 2)  # and the warm-up's two forwards
        assert engine.model.decode_kernel == "torch"  # the native decode step is native_cpu's alone
    before = CountingBackend.calls
    with Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["ab-count"], attention_backend="native_cpu") as e:
        assert greedy(e) == reference
        assert set(e.stats().attention_calls) == {"native_cpu"} and CountingBackend.calls == before


def test_the_cli_runs_a_plugin_backend_in_its_own_process(plugin_env: PluginEnv, ckpt: Path, tmp_path: Path) -> None:
    """`rtpcore generate --attention-backend NAME`: the plugin's backend attends (its calls land in
    the file), and the tokens are the reference's."""
    counting_dist(plugin_env, "ab-cli")
    count = tmp_path / "calls"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(plugin_env.site), os.environ.get("PYTHONPATH")) if p),
           "AB_COUNT_FILE": str(count)}

    def generate(*extra: str) -> list[int]:
        proc = subprocess.run(
            [sys.executable, "-m", "rtpcore", "generate", str(ckpt), "--prompt-ids", "5,9,33", "--max-new-tokens", "6",
             "--json", "--plugins", "ab-cli", *extra],
            capture_output=True, text=True, env=env, timeout=600, check=False,  # only against a hang
        )
        assert proc.returncode == 0, proc.stderr
        ids: list[int] = json.loads(proc.stdout)["output_ids"]
        return ids

    ours = generate("--attention-backend", "counting")
    assert count.exists() and len(count.read_text()) > 0
    count.unlink()
    assert generate("--attention-backend", "torch") == ours
    assert not count.exists()
    proc = subprocess.run(
        [sys.executable, "-m", "rtpcore", "generate", str(ckpt), "--prompt-ids", "1", "--plugins", "ab-cli",
         "--attention-backend", "nosuch"], capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert proc.returncode == 1
    assert "attention_backend='nosuch'" in proc.stderr and "counting, native_cpu, torch" in proc.stderr


def test_a_backend_that_cannot_serve_a_layer_is_named_with_the_layer_and_its_reason(
    plugin_env: PluginEnv, ckpt: Path
) -> None:
    plugin_env.add_dist("ab-mla", plugins={"ab_mla": "ab_mla"}, modules={"ab_mla.py": (
        "from rtpcore import hookimpl\nfrom rtpcore.attention import TorchAttentionBackend\n"
        "class MlaOnly(TorchAttentionBackend):\n    name = 'mla_only'\n    priority = 99\n"
        "    @classmethod\n    def supports(cls, kv_spec, device, dtype):\n"
        "        return True if kv_spec.kind == 'mla' else 'it serves latent caches only'\n"
        "@hookimpl\ndef rtpcore_register_attention_backends(registry):\n"
        "    registry.register_attention_backend(MlaOnly)\n")})
    with pytest.raises(AttentionBackendError) as excinfo:
        Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["ab-mla"], attention_backend="mla_only")
    message = str(excinfo.value)
    assert "'mla_only'" in message and "layer 0" in message and "it serves latent caches only" in message
    assert excinfo.value.__cause__ is None or isinstance(excinfo.value, AttentionBackendError)
    # Not named: the automatic choice passes it over (its priority notwithstanding).
    with Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["ab-mla"]) as engine:
        assert {c.attention_backend.name for c in engine.kv_caches} == {"native_cpu"}
    with pytest.raises(AttentionBackendError, match=r"attention_backend='nope' is not an attention backend here; "
                                                    r"known: mla_only, native_cpu, torch"):
        Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["ab-mla"], attention_backend="nope")


def test_choose_explains_a_layer_nothing_serves() -> None:
    """Without the reference, a layer no backend supports is an error listing each one's reason."""
    from rtpcore_native import KVCacheSpecDesc, build_kv_cache_spec

    spec = build_kv_cache_spec(KVCacheSpecDesc(tag="layer0", kind="mla", dtype="fp8_e4m3", kv_lora_rank=512,
                                               rope_head_dim=64, tokens_per_block=64, layout="padded"))
    with pytest.raises(AttentionBackendError, match=r"no attention backend serves layer 0 .*native_cpu: it serves "
                                                    r"multi-head/grouped-query caches, and this layer's is 'mla'"):
        choose_attention_backends([spec], {"native_cpu": NativeCpuAttentionBackend}, device="cpu", dtype=None)


@pytest.mark.parametrize(("body", "error", "rule"), [
    ("class B(TorchAttentionBackend):\n    name = 'b'\n    api_version = '2.0'\n", PluginIncompatibleError,
     "written for the attention_backends API 2.0, and this rtpcore runs 1.0"),
    ("class B(TorchAttentionBackend):\n    name = 'b'\n    priority = 'high'\n", PluginLoadError,
     "priority must be an integer, got 'high'"),
    ("class B(AttentionBackend):\n    name = 'b'\n", PluginLoadError, "does not implement supports"),
    ("class B:\n    name = 'b'\n", PluginLoadError, "must be a subclass of rtpcore.attention.AttentionBackend"),
    ("class B(TorchAttentionBackend):\n    name = 'torch'\n", PluginConflictError, "attention backend 'torch'"),
])
def test_a_wrong_backend_is_refused_and_nothing_registers(plugin_env: PluginEnv, body: str, error: type[Exception],
                                                          rule: str) -> None:
    plugin_env.add_dist("ab-bad", plugins={"ab_bad": "ab_bad"}, modules={"ab_bad.py": (
        "from rtpcore import hookimpl\nfrom rtpcore.attention import AttentionBackend, TorchAttentionBackend\n"
        f"{body}"
        "@hookimpl\ndef rtpcore_register_models(registry):\n"
        "    registry.register('ab_bad:M', model_type='ab_bad_model', architectures=('AbBad',))\n"
        "@hookimpl\ndef rtpcore_register_attention_backends(registry):\n"
        "    registry.register_attention_backend(B)\n")})
    with pytest.raises(error) as excinfo:
        load_plugins(Allowlist.from_cli(plugins=["ab-bad"]).resolve())
    assert rule in str(excinfo.value) and "ab-bad" in str(excinfo.value)


def test_replaces_takes_over_a_built_in_name(plugin_env: PluginEnv, ckpt: Path) -> None:
    counting_dist(plugin_env, "ab-take", name="faster_torch", replaces=("torch",))
    registry = load_plugins(Allowlist.from_cli(plugins=["ab-take"]).resolve())
    assert registry.seam_class("attention_backends", "torch").__module__ == "ab_take"
    with Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["ab-take"], attention_backend="torch") as engine:
        assert {type(c.attention_backend).__module__ for c in engine.kv_caches} == {"ab_take"}
        greedy(engine)
        assert set(engine.stats().attention_calls) == {"faster_torch"}


@pytest.mark.slow
def test_a_plugin_backend_on_two_gloo_ranks_equals_one_rank(plugin_env: PluginEnv, ckpt: Path,
                                                           reference: list[list[int]]) -> None:
    counting_dist(plugin_env, "ab-tp")
    options = {"tokens_per_block": 4, "plugins": ["ab-tp"], "attention_backend": "counting"}
    with Engine.from_pretrained(ckpt, tensor_parallel_size=2, **options) as engine:
        assert greedy(engine) == reference
        assert engine.stats().attention_calls["counting"] > 0


@pytest.mark.slow
def test_atom_mla_equals_the_reference_mla() -> None:
    """atom-plugin's MLA kernels (its atom_mla backend, chosen by priority) and rtpcore's reference
    MLA (the torch backend's expanded form) give the same greedy tokens on its demo model."""
    from rtpcore.testing import demo_checkpoint

    path = demo_checkpoint("deepseek_v3", plugins=["atom-plugin"])
    outs, calls = [], []
    for backend in (None, "torch"):
        with Engine.from_pretrained(path, plugins=["atom-plugin"], tokens_per_block=4, attention_backend=backend) as e:
            outs.append(greedy(e))
            calls.append(set(e.stats().attention_calls))
    assert calls == [{"atom_mla"}, {"torch"}]
    assert outs[0] == outs[1]
