"""The conformance kit's seam checks (docs/design.md §19): ``attention_backend``,
``quantization_method``, ``reasoning_parser``, ``tool_parser``, ``logits_processor`` and ``platform`` pass on
rtpcore's built-in plugin and on atom-plugin (or skip saying why, as ``cuda`` without a GPU), and
each fails, naming its rule and what it saw, on a broken seam class of a real distribution."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugin_env import PluginEnv
from rtpcore.testing.kit import RULES, CheckResult, plan_checks

SEAM_CHECKS = ["attention_backend", "quantization_method", "reasoning_parser", "tool_parser", "logits_processor",
               "platform"]

# Seam classes that keep their contracts (a plugin with seams only: the kit tries them on the
# built-in Llama demo).
GOOD = '''
import json

from rtpcore import ParsedToolCalls, ToolCall, ToolCallParser, hookimpl
from rtpcore.attention import TorchAttentionBackend
from rtpcore.logits import LogitsProcessor
from rtpcore.platforms import Platform
from rtpcore.quantization import Int8Method, QuantizationMethod
from rtpcore.reasoning import ThinkTagsReasoningParser


class Echo(TorchAttentionBackend):
    """The reference's calls under another name."""
    name = "echo"


class MyInt8(Int8Method):
    name = "my_int8"


class HalfWeights(QuantizationMethod):
    """Its own layers: weights kept in float16, computed in float32 (within the e4m3 bound)."""
    name = "half_weights"

    @classmethod
    def from_config(cls, quantization_config):
        return cls()

    def create_weights(self, layer, weight, bias):
        layer.register_buffer("weight", weight.half(), persistent=False)
        layer.register_buffer("bias", bias, persistent=False)
        return True

    def apply(self, layer, x):
        import torch.nn.functional as F

        return F.linear(x, layer.weight.to(x.dtype), layer.bias)


class Brackets(ThinkTagsReasoningParser):
    name = "brackets"
    start, end = "[[", "]]"


class Longer(LogitsProcessor):
    """Each row loses as many logits as its request wrote tokens (a row-wise rule)."""
    name = "longer"

    def __init__(self, engine_config, device):
        super().__init__(engine_config, device)
        self.outputs = {}

    def update_state(self, batch_update):
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.outputs.pop(row, None)
        for row, _params, _prompt, output_ids in batch_update.added:
            self.outputs[row] = output_ids
        for a, b in batch_update.moved:
            x, y = self.outputs.pop(a, None), self.outputs.pop(b, None)
            if x is not None:
                self.outputs[b] = x
            if y is not None:
                self.outputs[a] = y

    def apply(self, logits):
        for row, output_ids in self.outputs.items():
            logits[row] -= len(output_ids)
        return logits


class Host(Platform):
    name = "host"
    device_type = "cpu"

    @classmethod
    def is_available(cls):
        return True


class Missing(Platform):
    name = "missing"
    device_type = "cpu"

    @classmethod
    def is_available(cls):
        import no_such_accelerator_runtime  # noqa: F401  the documented way to say "not here"


@hookimpl
def rtpcore_register_attention_backends(registry):
    registry.register_attention_backend(Echo)


@hookimpl
def rtpcore_register_quantization_methods(registry):
    registry.register_quantization_method(MyInt8)
    registry.register_quantization_method(HalfWeights)


@hookimpl
def rtpcore_register_reasoning_parsers(registry):
    registry.register_reasoning_parser(Brackets)


@hookimpl
def rtpcore_register_logits_processors(registry):
    registry.register_logits_processor(Longer)


@hookimpl
def rtpcore_register_platforms(registry):
    registry.register_platform(Host)
    registry.register_platform(Missing)


class Calls(ToolCallParser):
    """<call>{"name": ..., "arguments": {...}} after content; the default feed and finish."""
    name = "calls"
    markers = ("<call>",)

    def parse(self, text):
        content, calls = [], []
        for i, part in enumerate(text.split("<call>")):
            try:
                obj = json.loads(part) if i else None
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls.append(ToolCall.of(obj["name"], obj.get("arguments", {})))
            else:
                content.append(part if i == 0 else "<call>" + part)
        return ParsedToolCalls("".join(content) or None, tuple(calls))


@hookimpl
def rtpcore_register_tool_parsers(registry):
    registry.register_tool_parser(Calls)
'''

# One broken class per seam.
BROKEN = '''
from rtpcore import hookimpl
from kit_good import Calls
from rtpcore.attention import TorchAttentionBackend
from rtpcore.logits import LogitsProcessor
from rtpcore.platforms import Platform
from rtpcore.quantization import Int8Method
from rtpcore.reasoning import DeepSeekR1ReasoningParser


class Hot(TorchAttentionBackend):
    """Softmax at the wrong temperature: scale * 1.5."""
    name = "hot"

    def attention(self, q, cache, batch, *, scale, **kw):
        return super().attention(q, cache, batch, scale=scale * 1.5, **kw)


class WrongScale(Int8Method):
    """int8 whose scales are 2% too large."""
    name = "wrong_scale"

    def create_weights(self, layer, weight, bias):
        super().create_weights(layer, weight, bias)
        layer.scales.mul_(1.02)
        layer.scales_f32.mul_(1.02)
        return True


class Lossy(DeepSeekR1ReasoningParser):
    """Drops the first character of every piece after the first."""
    name = "lossy"

    def feed(self, delta):
        first = not getattr(self, "_fed", False)
        self._fed = True
        return super().feed(delta if first else delta[1:])


class BatchNorm(LogitsProcessor):
    """Centres the logits over the whole batch: a row's result depends on the others."""
    name = "batch_norm"

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        return logits - logits.mean()


class Liar(Platform):
    name = "liar"
    device_type = "cpu"

    @classmethod
    def is_available(cls):
        return True

    @classmethod
    def memory_info(cls):
        return 10, 5


@hookimpl
def rtpcore_register_attention_backends(registry):
    registry.register_attention_backend(Hot)


@hookimpl
def rtpcore_register_quantization_methods(registry):
    registry.register_quantization_method(WrongScale)


@hookimpl
def rtpcore_register_reasoning_parsers(registry):
    registry.register_reasoning_parser(Lossy)


@hookimpl
def rtpcore_register_logits_processors(registry):
    registry.register_logits_processor(BatchNorm)


@hookimpl
def rtpcore_register_platforms(registry):
    registry.register_platform(Liar)


class Clipped(Calls):
    """Streams lose the last character of every piece but the last."""
    name = "clipped"

    def feed(self, text):
        self._fed().append(text[:-1] if len(text) > 1 else text)
        return ()


@hookimpl
def rtpcore_register_tool_parsers(registry):
    registry.register_tool_parser(Clipped)
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginEnv]:
    site = PluginEnv(tmp_path_factory.mktemp("kit-seams-site"))
    site.add_dist("kit-good", plugins={"kit_good": "kit_good"}, modules={"kit_good.py": GOOD})
    site.add_dist("kit-broken", plugins={"kit_broken": "kit_broken"}, modules={"kit_broken.py": BROKEN})
    yield site
    sys.path.remove(str(site.site))
    for name in ("kit_good", "kit_broken"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kit-demo")


def run(item: str, cache: Path, checks: list[str] = SEAM_CHECKS) -> dict[str, CheckResult]:
    return {planned.id: planned.run() for planned in plan_checks(item, checks=checks, cache_dir=cache)}


def statuses(results: dict[str, CheckResult]) -> dict[str, str]:
    return {key: result.status for key, result in results.items()}


def test_the_built_in_plugin_passes_its_seam_checks(cache: Path) -> None:
    """Every built-in backend, method, parser and platform passes; cuda skips where torch sees no GPU."""
    import torch

    results = run("rtpcore.models", cache)
    cuda = "ok" if torch.cuda.is_available() else "skip"
    assert statuses(results) == {
        "attention_backend[native_cpu]": "ok", "attention_backend[torch]": "ok",
        "quantization_method[fp8]": "ok", "quantization_method[int8]": "ok",
        "quantization_method[gguf]": "ok",
        "reasoning_parser[deepseek_r1]": "ok", "reasoning_parser[qwen3]": "ok",
        "platform[cpu]": "ok", "platform[cuda]": cuda,
    }, {k: r.detail for k, r in results.items()}
    assert "equal to torch on llama, fp32 KV cache" in results["attention_backend[native_cpu]"].detail
    assert "not served: llama (fp8 KV cache)" in results["attention_backend[native_cpu]"].detail
    assert "reference backend" in results["attention_backend[torch]"].detail
    assert "from an fp8 copy (blocks of 16 x 16), kernel plain, within float32 rounding" in \
        results["quantization_method[fp8]"].detail
    assert "from the float checkpoint, kernel int8" in results["quantization_method[int8]"].detail
    assert "from a GGUF file in Q8_0, kernel gguf, within 8-bit activations per block of 32" in \
        results["quantization_method[gguf]"].detail
    if cuda == "skip":
        assert results["platform[cuda]"].detail == "platform 'cuda' is unavailable here: is_available() returned False"


def test_atom_plugin_passes_its_seam_checks(cache: Path) -> None:
    """atom_mla equals the reference on both DeepSeek demos with float32 and fp8 KV caches;
    atom_fp8 (which takes over fp8) reads the fp8 copy within e4m3 rounding; its parser streams."""
    pytest.importorskip("atom_plugin")
    results = run("atom-plugin", cache)
    assert statuses(results) == {
        "attention_backend[atom_mla]": "ok", "quantization_method[atom_fp8]": "ok", "quantization_method[fp8]": "ok",
        "reasoning_parser[atom_deepseek_r1]": "ok", "tool_parser[deepseek_v3]": "ok",
    }, {k: r.detail for k, r in results.items()}
    detail = results["attention_backend[atom_mla]"].detail
    for model_type in ("deepseek_v2", "deepseek_v3"):
        assert f"{model_type}, fp32 KV cache" in detail and f"{model_type}, fp8_e4m3 KV cache" in detail
    assert "from an fp8 copy" in results["quantization_method[atom_fp8]"].detail


def test_seam_classes_that_keep_their_contracts_pass(env: PluginEnv, cache: Path) -> None:
    """A seam-only plugin is tried on the built-in Llama; a platform whose is_available raises
    (ImportError: its runtime is not installed) is a skip quoting it."""
    results = run("kit-good", cache)
    assert statuses(results) == {
        "attention_backend[echo]": "ok", "quantization_method[my_int8]": "ok",
        "quantization_method[half_weights]": "ok", "reasoning_parser[brackets]": "ok",
        "logits_processor[longer]": "ok", "platform[host]": "ok", "platform[missing]": "skip",
        "tool_parser[calls]": "ok",
    }, {k: r.detail for k, r in results.items()}
    assert "not served: llama (fp8" not in results["attention_backend[echo]"].detail  # it serves fp8 caches too
    assert "llama, fp8_e4m3 KV cache" in results["attention_backend[echo]"].detail
    assert "is_available() raised ModuleNotFoundError" in results["platform[missing]"].detail
    assert "kernel half_weights, within e4m3 rounding" in results["quantization_method[half_weights]"].detail
    assert "calls found whole" in results["tool_parser[calls]"].detail


@pytest.mark.parametrize(("check", "subject", "seen"), [
    ("attention_backend", "hot", "llama, fp32 KV cache: prompt 0 (3 tokens), new token 0: log-probability of token"),
    ("quantization_method", "wrong_scale", "the effective weight (the layer's output for unit rows) is off the float "
                                           "reference by more than half an int8 step of its row"),
    ("reasoning_parser", "lossy", "fed in pieces"),
    ("tool_parser", "clipped", "parse of the whole answer"),
    ("logits_processor", "batch_norm", "differ from its row in the batch of 3"),
    ("platform", "liar", "liar.memory_info() returned (free=10, total=5)"),
])
def test_a_broken_seam_class_fails_its_check(env: PluginEnv, cache: Path, check: str, subject: str,
                                             seen: str) -> None:
    """The failure's detail is the check's rule, then what was seen."""
    result = run("kit-broken", cache, [check])[f"{check}[{subject}]"]
    assert result.status == "FAIL", result.detail
    assert result.detail.startswith(f"rule: {RULES[check]}\n")
    assert seen in result.detail


def test_a_reasoning_failure_shows_the_text_the_split_and_both_results(env: PluginEnv, cache: Path) -> None:
    detail = run("kit-broken", cache, ["reasoning_parser"])["reasoning_parser[lossy]"].detail
    # The first text with a split: the plain answer, split after its first character.
    assert ("text 'plain answer, no tags at all' fed in pieces ['p', 'lain answer, no tags at all'] (split at [1]), "
            "then finish: assembled (reasoning, content) ('pain answer, no tags at all', ''); extract returned "
            "('plain answer, no tags at all', '')") in detail
