"""The conformance kit (docs/design.md §19): the checks a plugin must pass, run on what it registers.

``rtpcore plugins test ITEM`` and ``pytest --rtpcore-plugin ITEM`` both come here: :func:`plan_checks`
loads the plugin (the allowlist item ``ITEM``; ``rtpcore.models`` names rtpcore's built-in plugin)
and lists one :class:`PlannedCheck` per check and subject -- the plugin itself, each model type,
attention backend, quantization method, reasoning parser, logits processor and platform it
registered -- and :meth:`PlannedCheck.run` runs one, giving a :class:`CheckResult`: ``ok``,
``FAIL`` (``detail``: the rule, then what was seen) or ``skip`` (``detail``: why; a check that
needs what the machine lacks is a skip, never ``ok``). :func:`run_kit` does both.

A check function takes the :class:`KitContext` and the subject's name; it returns normally
(passed; a returned string is a note shown beside ``ok``), or raises :class:`CheckFailed` or
:class:`CheckSkipped`. Both are also what the public ``check_*`` functions of
``rtpcore.testing`` raise, so a plugin's own pytest suite runs them on its own models: a
:class:`CheckFailed` is an ``AssertionError`` (a test failure) and a :class:`CheckSkipped` a
``unittest.SkipTest`` (pytest reports a skip).

Public constants: :data:`CHECKS` (every check's name, in the order the kit runs them) and
:data:`RULES` (each check's rule, the first line of its failure detail).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
import traceback
import unittest
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rtpcore.errors import RtpcoreError
from rtpcore.plugins.loading import BUILTIN_PLUGIN

__all__ = [
    "CHECKS",
    "RULES",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "KitContext",
    "PlannedCheck",
    "plan_checks",
    "run_check",
    "run_kit",
]

#: The item that names rtpcore's built-in plugin (its models, backends, methods, parsers, platforms).
BUILTIN_ITEM = BUILTIN_PLUGIN


class CheckFailed(AssertionError):
    """A check's rule was broken: ``detail`` is the rule, then what was seen."""

    def __init__(self, rule: str, seen: str) -> None:
        self.rule = rule
        self.seen = seen
        super().__init__(f"rule: {rule}\n{seen}")

    @property
    def detail(self) -> str:
        return str(self)


class CheckSkipped(unittest.SkipTest):
    """A check that does not apply here (its reason: what is missing)."""


@attrs.frozen
class CheckResult:
    """One check on one subject: ``status`` is ``"ok"``, ``"FAIL"`` or ``"skip"``."""

    check: str
    subject: str | None
    status: str
    seconds: float
    detail: str = ""

    @property
    def id(self) -> str:
        """``check`` or ``check[subject]``, as the report and pytest name it."""
        return self.check if self.subject is None else f"{self.check}[{self.subject}]"

    def as_json(self) -> dict[str, Any]:
        return {"check": self.check, "subject": self.subject, "status": self.status,
                "seconds": round(self.seconds, 3), "detail": self.detail}


@attrs.frozen
class _Check:
    name: str
    kind: str  # the subject kind: "plugin", "models" or a seam name
    rule: str
    target: str  # "module:function", imported when the check runs


_PLUGIN = "rtpcore.testing._checks_plugin"
_MODEL = "rtpcore.testing._checks_model"
_ENGINE = "rtpcore.testing._checks_engine"
_SEAMS = "rtpcore.testing._checks_seams"
_PARSERS = "rtpcore.testing._checks_parsers"

_TABLE = (
    _Check("registration", "plugin", "the plugin loads atomically, and every class it registers imports and passes "
           "registration (names, versions, forward_contract)", f"{_PLUGIN}:registration"),
    _Check("import_cost", "plugin", "importing the plugin and running its hooks stays under the budget and never "
           "imports torch", f"{_PLUGIN}:import_cost"),
    _Check("no_patches", "plugin", "loading the plugin and building its models changes no attribute of rtpcore",
           f"{_PLUGIN}:no_patches"),
    _Check("config_errors", "models", "each field of the demo config, given a malformed value, is a CheckpointError "
           "naming the field", f"{_MODEL}:config_errors"),
    _Check("weight_patterns", "models", "the model reads exactly the tensors its weight_patterns declare",
           f"{_MODEL}:weight_patterns"),
    _Check("forward_contract", "models", "the forward returns one finite (N, vocab) float row per logits index "
           "(docs/design.md §4)", f"{_MODEL}:forward_contract"),
    _Check("kv_layout", "models", "each layer's KV bytes are where its spec's regions say, and decode to what was "
           "written within the dtype's rounding", f"{_MODEL}:kv_layout"),
    _Check("batch_invariance", "models", "greedy output of a prompt alone equals its output in a batch",
           f"{_ENGINE}:batch_invariance"),
    _Check("chunked_prefill_invariance", "models", "greedy output is the same when the prompt is prefilled in "
           "chunks next to other requests' decodes", f"{_ENGINE}:chunked_prefill_invariance"),
    _Check("prefix_cache_invariance", "models", "greedy output is the same when the prompt's first blocks come "
           "from the prefix cache", f"{_ENGINE}:prefix_cache_invariance"),
    _Check("preemption_invariance", "models", "greedy output is the same when the request is preempted and "
           "recomputed", f"{_ENGINE}:preemption_invariance"),
    _Check("tensor_parallel", "models", "greedy output with tensor_parallel_size=2 (gloo) equals one rank's",
           f"{_ENGINE}:tensor_parallel"),
    _Check("draft", "models", "greedy output with the plugin's draft (speculative decoding) equals output without",
           f"{_ENGINE}:draft"),
    _Check("hf_parity", "models", "greedy tokens equal those of the transformers class the plugin names",
           f"{_ENGINE}:hf_parity"),
    _Check("graph_replay", "models", "decode steps replayed from CUDA graphs give the tokens of eager steps",
           f"{_ENGINE}:graph_replay"),
    _Check("attention_backend", "attention_backends", "the backend's attention equals the reference backend's "
           "within the documented tolerance", f"{_SEAMS}:attention_backend"),
    _Check("quantization_method", "quantization_methods", "the method's linear layers equal a float reference "
           "within the documented tolerance", f"{_SEAMS}:quantization_method"),
    _Check("reasoning_parser", "reasoning_parsers", "the streamed pieces (feed, finish) assemble to what extract "
           "returns for the whole text", f"{_PARSERS}:reasoning_parser"),
    _Check("tool_parser", "tool_parsers", "the streamed pieces (feed, finish) give the calls and content that parse "
           "gives for the whole answer", f"{_PARSERS}:tool_parser"),
    _Check("logits_processor", "logits_processors", "the processor keeps the logits' shape and rows, and a row's "
           "result does not depend on the other rows", f"{_SEAMS}:logits_processor"),
    _Check("platform", "platforms", "the platform answers its questions (availability, memory, dtypes, default "
           "backend) with well-formed values, raising nothing", f"{_SEAMS}:platform"),
)

#: Every check's name, in the order the kit runs them.
CHECKS: tuple[str, ...] = tuple(c.name for c in _TABLE)
#: Each check's rule, the first line of a failure's detail.
RULES: dict[str, str] = {c.name: c.rule for c in _TABLE}
_BY_NAME = {c.name: c for c in _TABLE}


def fail(check: str, seen: str) -> CheckFailed:
    """The failure of ``check``: its rule, and what was seen."""
    return CheckFailed(RULES[check], seen)


class KitContext:
    """What the checks of one plugin share: the item, the loaded registry, the device, demo checkpoints.

    ``plugins`` is what an engine of the plugin's models is built with (``()`` for the built-in
    plugin); ``name`` the plugin's name (its entry point), ``distribution`` its distribution.
    ``checkpoints`` (model type -> folder) replaces the demo checkpoints of those models, and
    ``prompts`` (token ids) the prompts of the checks that generate: a plugin's own models and
    prompts.
    """

    def __init__(self, item: str, *, device: str = "cpu", import_budget: float = 1.0,
                 cache_dir: Path | None = None, checkpoints: Mapping[str, str | os.PathLike[str]] | None = None,
                 prompts: Sequence[Sequence[int]] | None = None) -> None:
        from rtpcore.plugins.allowlist import Allowlist
        from rtpcore.plugins.loading import load_report

        if device not in ("cpu", "cuda"):
            raise RtpcoreError(f"device {device!r}: the kit runs on 'cpu' or 'cuda'")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                from rtpcore.errors import DeviceError

                raise DeviceError("device 'cuda' is not available: torch sees no CUDA or ROCm GPU", device=device,
                                  available=("cpu",))
        self.item = item
        self.device = device
        self.import_budget = import_budget
        self.cache_dir = cache_dir
        self.builtin = item == BUILTIN_ITEM
        self.plugins: tuple[str, ...] = () if self.builtin else (item,)
        allowlist = Allowlist.from_cli(plugins=self.plugins)
        plan = allowlist.resolve(strict=False)
        if plan.failures:
            raise plan.failures[0].error()
        entry = plan.entries[0] if plan.entries else None
        self.name = BUILTIN_PLUGIN if entry is None else entry.name
        self.distribution = "rtpcore" if entry is None else entry.distribution
        self.version = None if entry is None else entry.version
        # Loaded with its patches accepted (and recorded): no_patches reports them, the other checks run.
        self.allow_patches: tuple[str, ...] = () if entry is None else (entry.name,)
        self.plan = Allowlist.from_cli(plugins=self.plugins, allow_plugin_patches=self.allow_patches).resolve(
            strict=False)
        self.report = load_report(self.plan, import_models=True)
        self.outcome = self.report.builtin if entry is None else self.report.outcomes[0]
        self.registry = self.report.registry
        self._demo: dict[str, Path] = {mt: Path(p) for mt, p in (checkpoints or {}).items()}
        #: The token-id prompts of the engine checks (None: each check's own).
        self.prompts: list[list[int]] | None = None if prompts is None else [list(p) for p in prompts]

    @property
    def engine_options(self) -> dict[str, Any]:
        """The keywords every engine the kit builds gets (the plugins, the device, patches accepted)."""
        return {"plugins": self.plugins, "allow_plugin_patches": self.allow_patches, "device": self.device}

    def subjects(self, kind: str) -> list[str]:
        """The names the plugin registered on ``kind`` ("models" or a seam), in order."""
        return list(dict(self.outcome.seams).get(kind, ()))

    def model_class(self, model_type: str) -> Any:
        return self.registry.get(model_type)

    def demo_checkpoint(self, model_type: str) -> Path:
        """The model's demo checkpoint (built once, cached): ``CheckSkipped`` when it has no demo_config()."""
        if model_type not in self._demo:
            from rtpcore.plugins.model_plugin import call_optional
            from rtpcore.testing.demo import ensure_demo_checkpoint

            plugin = self.model_class(model_type)
            if call_optional(plugin, "demo_config") is None:
                raise CheckSkipped(f"model type {model_type!r} offers no demo_config(), so the kit has no checkpoint")
            self._demo[model_type] = ensure_demo_checkpoint(plugin, cache_dir=self.cache_dir)
        return self._demo[model_type]

    def demo_config_value(self, model_type: str, key: str) -> Any:
        """``key`` of the model's demo config.json (None when absent)."""
        from rtpcore.checkpoint import read_hf_config

        return read_hf_config(self.demo_checkpoint(model_type)).get(key)

    def demo_model_types(self) -> list[str]:
        """The plugin's model types that have a demo config, else the built-in Llama (the model a
        seam-only plugin's backends and methods are tried on)."""
        from rtpcore.plugins.model_plugin import call_optional

        own = [m for m in self.subjects("models") if call_optional(self.model_class(m), "demo_config") is not None]
        return own or ["llama"]

    @contextlib.contextmanager
    def engine(self, checkpoint: Path | str, **options: Any) -> Iterator[Any]:
        """An engine on ``checkpoint`` with the plugin loaded, closed after the block."""
        from rtpcore.engine import Engine

        engine = Engine.from_pretrained(checkpoint, **{**self.engine_options, **options})
        try:
            yield engine
        finally:
            engine.close()


@attrs.frozen
class PlannedCheck:
    """One check on one subject, ready to run."""

    check: str
    subject: str | None
    context: KitContext = attrs.field(eq=False, repr=False)

    @property
    def id(self) -> str:
        return self.check if self.subject is None else f"{self.check}[{self.subject}]"

    def run(self) -> CheckResult:
        spec = _BY_NAME[self.check]
        start = time.perf_counter()
        try:
            module, func = spec.target.split(":")
            note = getattr(importlib.import_module(module), func)(self.context, self.subject)
        except CheckFailed as exc:
            return self._result("FAIL", start, exc.detail)
        except CheckSkipped as exc:
            return self._result("skip", start, str(exc))
        except Exception as exc:  # a check's own bug, or the plugin's code raising where it should not
            return self._result("FAIL", start, f"rule: {spec.rule}\n{describe_exception(exc)}")
        return self._result("ok", start, note or "")

    def _result(self, status: str, start: float, detail: str) -> CheckResult:
        return CheckResult(self.check, self.subject, status, time.perf_counter() - start, detail)


def plan_checks(item: str, *, checks: Sequence[str] | None = None, device: str = "cpu",
                import_budget: float = 1.0, **options: Any) -> list[PlannedCheck]:
    """The checks to run on the plugin ``item`` (an allowlist item, or ``rtpcore.models``): each
    of ``checks`` (None: all of :data:`CHECKS`) once per subject it applies to. A plugin that
    cannot be resolved raises its PluginError; a plugin that fails to load still gets its
    ``registration`` check (which reports the failure) and the checks that need no load.
    ``options``: :class:`KitContext`'s ``checkpoints``, ``prompts`` and ``cache_dir``."""
    unknown = [c for c in checks or () if c not in _BY_NAME]
    if unknown:
        raise RtpcoreError(f"unknown check {unknown[0]!r}; the checks are: {', '.join(CHECKS)}")
    context = KitContext(item, device=device, import_budget=import_budget, **options)
    wanted = set(checks) if checks else set(CHECKS)
    loaded = context.outcome.state in ("loaded", "registered")
    planned = []
    for spec in _TABLE:
        if spec.name not in wanted:
            continue
        if spec.kind == "plugin":
            planned.append(PlannedCheck(spec.name, None, context))
        elif loaded:
            subjects = context.subjects(spec.kind)
            if spec.name == "kv_layout":  # the plugin's own KV layouts too, each on its own
                subjects += [s for s in context.subjects("kv_layouts") if s not in subjects]
            planned += [PlannedCheck(spec.name, s, context) for s in subjects]
    return planned


def run_kit(item: str, *, checks: Sequence[str] | None = None, device: str = "cpu", import_budget: float = 1.0,
            on_result: Callable[[CheckResult], None] | None = None, **context: Any) -> list[CheckResult]:
    """Run the kit on ``item`` and return every result (``on_result`` sees each as it ends);
    ``context``: :class:`KitContext`'s ``checkpoints``, ``prompts`` and ``cache_dir``."""
    results = []
    for planned in plan_checks(item, checks=checks, device=device, import_budget=import_budget, **context):
        result = planned.run()
        if on_result is not None:
            on_result(result)
        results.append(result)
    return results


def run_check(item: str, check: str, subject: str | None = None, *, device: str = "cpu",
              **context: Any) -> CheckResult:
    """Run one check on one subject of ``item`` (a model type, or a seam's name; None for the
    plugin-level checks) and raise what it found: :class:`CheckFailed` (an AssertionError) or
    :class:`CheckSkipped` (pytest reports a skip); the result when it passed. ``context``:
    :class:`KitContext`'s ``checkpoints`` and ``prompts``, for a plugin's own models and prompts::

        run_check("my-plugin", "batch_invariance", "my_model", checkpoints={"my_model": path},
                  prompts=[[1, 2, 3], [4, 5, 6, 7]])
    """
    if check not in _BY_NAME:
        raise RtpcoreError(f"unknown check {check!r}; the checks are: {', '.join(CHECKS)}")
    result = PlannedCheck(check, subject, KitContext(item, device=device, **context)).run()
    if result.status == "FAIL":
        raise CheckFailed(RULES[check], result.detail.split("\n", 1)[1] if "\n" in result.detail else "")
    if result.status == "skip":
        raise CheckSkipped(result.detail)
    return result


def describe_exception(exc: BaseException) -> str:
    """``Type: message``, then the frames of the traceback outside rtpcore (the plugin's own
    code, where the fix is); all frames when none is outside."""
    frames = traceback.extract_tb(exc.__traceback__)
    outside = [f for f in frames if not _is_rtpcore_file(f.filename)]
    shown = outside or frames
    lines = [f"{type(exc).__name__}: {exc}"]
    lines += [f"  at {f.filename}:{f.lineno} in {f.name}" for f in shown[-4:]]
    return "\n".join(lines)


def _is_rtpcore_file(filename: str) -> bool:
    """Whether ``filename`` is rtpcore's own code, or a library's it calls through (torch, pluggy)."""
    roots = []
    for name in ("rtpcore", "rtpcore_native", "torch", "pluggy"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            roots.append(Path(module.__file__).resolve().parent)  # type: ignore[arg-type]
    path = Path(filename).resolve()
    return any(path.is_relative_to(root) for root in roots)
