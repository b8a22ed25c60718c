"""The quantization-method seam (docs/design.md §18): the built-in ``fp8`` and ``int8`` on it,
plugin methods registered through the ``rtpcore_register_quantization_methods`` hook of a real
distribution -- one chosen by ``quant_method`` extending ``fp8`` (equal tokens, its extra tensors
in the pruned load), one building its own layers chosen by ``--quantization`` -- and each wrong
use: an unknown ``quant_method`` (naming the installed plugin that declares it), an unknown
``--quantization``, a malformed or conflicting class."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_env import PluginEnv
from rtpcore import Allowlist, Engine, load_plugins
from rtpcore.errors import (
    CheckpointError,
    PluginConflictError,
    PluginIncompatibleError,
    PluginLoadError,
    RtpcoreError,
)
from rtpcore.layers import Linear
from rtpcore.quantization import Fp8Method, GgufMethod, Int8Method, quantization_method

pytest.importorskip("transformers")

PROMPTS = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [100]]

# Two plugin methods: fp8 under another name, counting what it adds to the load; and one that
# builds its own layers (weights kept in float16, computed in float32), counting its calls.
METHODS = '''
import os
import torch
import torch.nn.functional as F
from rtpcore import hookimpl
from rtpcore.quantization import Fp8Method, QuantizationMethod


class MyFp8(Fp8Method):
    name = "my_fp8"
    selected = []

    def select(self, selection, names, slices=None):
        scaled = super().select(selection, names, slices)
        type(self).selected.append(len(scaled.scales))
        return scaled


class HalfWeights(QuantizationMethod):
    name = "half_weights"
    applied = 0

    @classmethod
    def from_config(cls, quantization_config):
        return cls()

    def create_weights(self, layer, weight, bias):
        layer.register_buffer("weight", weight.half(), persistent=False)
        layer.register_buffer("bias", bias, persistent=False)
        return True

    def apply(self, layer, x):
        type(self).applied += 1
        path = os.environ.get("QM_COUNT_FILE")
        if path:
            with open(path, "a") as f:
                f.write("x")
        return F.linear(x, layer.weight.to(x.dtype), layer.bias)


@hookimpl
def rtpcore_register_quantization_methods(registry):
    registry.register_quantization_method(MyFp8)
    registry.register_quantization_method(HalfWeights)
'''


def methods_dist(env: PluginEnv, dist: str = "qm-mine") -> None:
    module = dist.replace("-", "_")
    env.add_dist(dist, plugins={module: module}, modules={f"{module}.py": METHODS})


def renamed(q_dir: Path, method: str) -> Path:
    config = json.loads((q_dir / "config.json").read_text())
    config["quantization_config"]["quant_method"] = method
    (q_dir / "config.json").write_text(json.dumps(config))
    return q_dir


def subprocess_env(env: PluginEnv, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(env.site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """An fp8 copy of the tiny Llama (its projections block-quantized) and its greedy tokens
    through the built-in fp8."""
    from test_checkpoint_quant import write_pair
    from test_llama import make_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    make_checkpoint(root / "src")
    q_dir, _ = write_pair(root / "src", root, (16, 16))
    with Engine.from_pretrained(q_dir, tokens_per_block=4) as engine:
        tokens = engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    return q_dir, tokens


def test_the_built_ins_resolve_by_quant_method_and_by_name(fp8_pair: tuple[Path, list[list[int]]]) -> None:
    registry = load_plugins(Allowlist.from_cli().resolve())
    classes = {n: registry.seam_class("quantization_methods", n) for n in registry.seam_names("quantization_methods")}
    assert classes == {"fp8": Fp8Method, "gguf": GgufMethod, "int8": Int8Method}
    hf = json.loads((fp8_pair[0] / "config.json").read_text())
    method = quantization_method(hf, classes)
    assert isinstance(method, Fp8Method) and method.config.block_size == (16, 16)
    assert quantization_method({"hidden_size": 8}, classes) is None
    int8 = quantization_method(hf, classes, requested="int8")  # int8 over an fp8 checkpoint: fp8 reads it
    assert isinstance(int8, Int8Method) and isinstance(int8.load, Fp8Method)
    with pytest.raises(CheckpointError, match=r"'fp8' reads fp8 block-quantized checkpoints, and this checkpoint's "
                                              r"config\.json has no quantization_config"):
        quantization_method({"hidden_size": 8}, classes, requested="fp8")


def test_a_plugin_method_chosen_by_quant_method_matches_the_built_in_it_extends(
    plugin_env: PluginEnv, fp8_pair: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    import shutil

    methods_dist(plugin_env)
    q_dir = renamed(Path(shutil.copytree(fp8_pair[0], tmp_path / "mine")), "my_fp8")
    from qm_mine import MyFp8  # type: ignore[import-not-found]

    with Engine.from_pretrained(q_dir, tokens_per_block=4, plugins=["qm-mine"]) as engine:
        assert engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[]) == fp8_pair[1]
    assert MyFp8.selected and all(n > 0 for n in MyFp8.selected)  # its scales entered the load
    # Without the plugin the checkpoint names a method nobody registered.
    with pytest.raises(CheckpointError, match=r"quant_method 'my_fp8' is not a quantization method here; "
                                              r"known: fp8, gguf, int8"):
        Engine.from_pretrained(q_dir, tokens_per_block=4)


def test_an_unknown_quant_method_names_the_installed_plugin_that_declares_it(
    plugin_env: PluginEnv, fp8_pair: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    import shutil

    info = plugin_env.add_dist("qm-hint", "2.5", plugins={"qm_hint": "qm_hint"},
                               modules={"qm_hint.py": METHODS})
    entry_points = info / "entry_points.txt"
    entry_points.write_text(entry_points.read_text() + "\n[rtpcore.quantization_methods]\nmy_fp8 = qm_hint\n")
    q_dir = renamed(Path(shutil.copytree(fp8_pair[0], tmp_path / "hinted")), "my_fp8")
    with pytest.raises(CheckpointError) as excinfo:
        Engine.from_pretrained(q_dir, tokens_per_block=4)
    message = str(excinfo.value)
    assert "quant_method 'my_fp8' is not a quantization method here; known: fp8, gguf, int8" in message
    assert "plugin 'qm_hint' of qm-hint 2.5" in message and "plugins=['qm-hint']" in message


def test_a_plugin_method_building_its_own_layers_runs_through_the_cli(
    plugin_env: PluginEnv, ckpt: Path, tmp_path: Path
) -> None:
    """--quantization half_weights: every Linear is the method's (kernel named after it) and the
    forward calls its apply; the float32 checkpoint's tokens survive float16 weights here."""
    methods_dist(plugin_env, "qm-cli")
    from qm_cli import HalfWeights  # type: ignore[import-not-found]

    with Engine.from_pretrained(ckpt, tokens_per_block=4, plugins=["qm-cli"], quantization="half_weights") as engine:
        kernels = {m.kernel for m in engine.model.modules() if isinstance(m, Linear)}
        out = engine.generate(PROMPTS, max_new_tokens=4, stop_token_ids=[])
    assert kernels == {"half_weights"} and HalfWeights.applied > 0 and len(out) == len(PROMPTS)
    count = tmp_path / "applied"
    run = subprocess.run(
        [sys.executable, "-m", "rtpcore", "generate", str(ckpt), "--prompt-ids", "5,9,33", "--max-new-tokens", "4",
         "--plugins", "qm-cli", "--quantization", "half_weights", "--json"],
        capture_output=True, text=True, env=subprocess_env(plugin_env, QM_COUNT_FILE=str(count)), timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert count.exists() and len(count.read_text()) > 0
    run = subprocess.run(
        [sys.executable, "-m", "rtpcore", "generate", str(ckpt), "--prompt-ids", "1", "--quantization", "nf4"],
        capture_output=True, text=True, env=subprocess_env(plugin_env), timeout=600, check=False,
    )
    assert run.returncode == 1
    assert "quantization must be None, 'none' or one of fp8, gguf, int8, got 'nf4'" in run.stderr


@pytest.mark.parametrize(("body", "error", "rule"), [
    ("class Q(Fp8Method):\n    name = 'q'\n    api_version = '2.0'\n", PluginIncompatibleError,
     "written for the quantization_methods API 2.0, and this rtpcore runs 1.0"),
    ("class Q(QuantizationMethod):\n    name = 'q'\n    def from_config(self, config):\n        return self\n",
     PluginLoadError, "from_config must be a classmethod"),
    ("class Q(QuantizationMethod):\n    name = 'q'\n", PluginLoadError, "does not implement from_config"),
    ("class Q(Fp8Method):\n    name = 'fp8'\n", PluginConflictError, "quantization method 'fp8'"),
])
def test_a_wrong_method_is_refused_and_nothing_registers(plugin_env: PluginEnv, body: str, error: type[Exception],
                                                         rule: str) -> None:
    plugin_env.add_dist("qm-bad", plugins={"qm_bad": "qm_bad"}, modules={"qm_bad.py": (
        "from rtpcore import hookimpl\nfrom rtpcore.quantization import Fp8Method, QuantizationMethod\n"
        f"{body}"
        "@hookimpl\ndef rtpcore_register_quantization_methods(registry):\n"
        "    registry.register_quantization_method(Q)\n")})
    with pytest.raises(error) as excinfo:
        load_plugins(Allowlist.from_cli(plugins=["qm-bad"]).resolve())
    assert rule in str(excinfo.value) and "qm-bad" in str(excinfo.value)


def test_an_unknown_quantization_is_refused_before_anything_loads(ckpt: Path) -> None:
    with pytest.raises(RtpcoreError, match="quantization must be None, 'none' or one of fp8, gguf, int8, got 'nf4'"):
        Engine.from_pretrained(ckpt, quantization="nf4")
