"""The conformance kit (docs/design.md §19) on broken plugins: each fails exactly its check, by name.

Every plugin here is a real distribution (a ``*.dist-info`` folder with ``entry_points.txt``, by
``plugin_env.PluginEnv.add_dist``) in a temporary site folder that is on ``sys.path`` and on
``PYTHONPATH`` (for the kit's command line and its probe processes). Their sources live in
``tests/kit_plugins/<package>/``, one package per plugin, each with one defect (its docstring
says which). All but kit-layout serve a model subclassing the built-in Llama plugin under its
own model type and architecture, registered lazily (``"module:Class"``) so that loading a plugin
imports no torch:

============  ===================  =========================================================
plugin        fails                its defect
============  ===================  =========================================================
kit-weights   weight_patterns      build_model reads ``model.extra_scale``, which no pattern declares
kit-config    config_errors        a malformed ``kit_logit_scale`` silently becomes 1.0
kit-batch     batch_invariance     with 3+ sequences in a step, each row gets the rows' mean added
kit-layout    kv_layout            an fp8 layout whose codec writes rounded integers, not fp8
kit-draft     draft                the MTP draft scales the target's embedding in place
kit-patch     no_patches           build_model replaces ``rtpcore.layers.causal_mask``
kit-slow      import_cost          the hooks module takes 2.5 s to import (budget 1.0 s)
kit-torch     import_cost          the hooks module imports torch
============  ===================  =========================================================

Each plugin's kit runs once, through the command line (``python -m rtpcore plugins test ITEM
--json``): the broken check is ``FAIL`` with that check's rule (``RULES[check]``) as the
detail's first line, no other check's rule, and what was seen; every other result is ``ok`` or
``skip``; the exit status is 1. rtpcore's built-in plugin and atom-plugin fail nothing, and
``pytest --rtpcore-plugin ITEM`` fails exactly the broken check's item.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from rtpcore.testing.kit import RULES

pytest_plugins = ["pytester"]

PLUGINS = Path(__file__).parent / "kit_plugins"


@attrs.frozen
class Broken:
    """A broken plugin: its distribution, the check it fails (on ``subject``), what the failure
    must show, and the kit's extra arguments."""

    dist: str
    check: str
    subject: str | None
    seen: tuple[str, ...]
    args: tuple[str, ...] = ()

    @property
    def package(self) -> str:
        return self.dist.replace("-", "_")

    @property
    def id(self) -> str:
        return self.check if self.subject is None else f"{self.check}[{self.subject}]"


BROKEN = (
    Broken("kit-weights", "weight_patterns", "kit_weights", ("'model.extra_scale'", "KitWeightsPlugin")),
    Broken("kit-config", "config_errors", "kit_config", ("kit_logit_scale='not-a-number' was accepted",)),
    Broken("kit-batch", "batch_invariance", "kit_batch", ("batched",)),
    Broken("kit-layout", "kv_layout", "kit_int_fp8", ("layout 'kit_int_fp8'", "region 'nope' (fp8_e4m3")),
    Broken("kit-draft", "draft", "kit_draft", ('draft_model="mtp"',)),
    Broken("kit-patch", "no_patches", None, ("rtpcore.layers.causal_mask replaced", "building and running kit_patch")),
    Broken("kit-slow", "import_cost", None, ("over the budget of 1.00 s",), ("--import-budget", "1.0")),
    Broken("kit-torch", "import_cost", None, ("imported torch (from kit_torch.hooks",)),
)


@attrs.frozen
class KitRun:
    """One run of ``rtpcore plugins test ITEM --json``."""

    returncode: int
    rows: list[dict[str, Any]]
    stderr: str
    seconds: float

    def by_id(self) -> dict[str, dict[str, Any]]:
        return {_row_id(r): r for r in self.rows}


def _row_id(row: dict[str, Any]) -> str:
    return row["check"] if row["subject"] is None else f"{row['check']}[{row['subject']}]"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every plugin of tests/kit_plugins installed as a distribution into one site folder, first on
    ``sys.path`` and on ``PYTHONPATH``; demo checkpoints go to a temporary ``XDG_CACHE_HOME``."""
    from plugin_env import PluginEnv

    root = tmp_path_factory.mktemp("kit_broken")
    saved_path = list(sys.path)
    env = PluginEnv(root)
    for broken in BROKEN:
        sources = {f"{broken.package}/{f.name}": f.read_text() for f in (PLUGINS / broken.package).glob("*.py")}
        env.add_dist(broken.dist, "1.0", plugins={broken.package: f"{broken.package}.hooks"}, modules=sources)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(env.site), *filter(None, [os.environ.get("PYTHONPATH")])]))
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))
        try:
            yield env.site
        finally:
            sys.path[:] = saved_path
            for name, module in list(sys.modules.items()):
                if (getattr(module, "__file__", None) or "").startswith(str(root)):
                    del sys.modules[name]
            importlib.invalidate_caches()


@pytest.fixture(scope="module")
def kit(site: Path) -> Callable[..., KitRun]:
    """``kit(item, *args)``: the kit's JSON report on ``item``, run once per item and arguments."""
    runs: dict[tuple[str, ...], KitRun] = {}

    def run(item: str, *args: str) -> KitRun:
        key = (item, *args)
        if key not in runs:
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "rtpcore", "plugins", "test", item, "--json", *args],
                                  capture_output=True, text=True, check=False)
            seconds = time.perf_counter() - start
            try:
                rows = json.loads(proc.stdout)
            except json.JSONDecodeError:
                pytest.fail(f"the kit on {item} printed no JSON (status {proc.returncode}):\n{proc.stdout}\n"
                            f"{proc.stderr}")
            runs[key] = KitRun(proc.returncode, rows, proc.stderr, seconds)
        return runs[key]

    return run


def _failures(run: KitRun, but: str | None = None) -> str:
    return "\n\n".join(f"{_row_id(r)}: {r['status']}\n{r['detail']}" for r in run.rows
                       if r["status"] not in ("ok", "skip") and _row_id(r) != but)


@pytest.mark.slow
@pytest.mark.parametrize("broken", BROKEN, ids=[f"{b.dist}-{b.check}" for b in BROKEN])
def test_a_broken_plugin_fails_its_check_and_no_other(kit: Callable[..., KitRun], broken: Broken) -> None:
    """The defect's check is FAIL with its rule and what was seen; the others are ok or skip."""
    run = kit(broken.dist, *broken.args)
    results = run.by_id()
    assert broken.id in results, f"the kit did not run {broken.id}: {sorted(results)}"
    row = results[broken.id]
    assert row["status"] == "FAIL", f"{broken.id} is {row['status']}: {row['detail']}"
    first, _, seen = row["detail"].partition("\n")
    assert first == f"rule: {RULES[broken.check]}"
    others = [c for c, rule in RULES.items() if c != broken.check and rule in row["detail"]]
    assert not others, f"the failure of {broken.id} quotes the rules of {others}"
    for words in broken.seen:
        assert words in seen, f"{words!r} not in what {broken.id} saw:\n{seen}"
    assert not _failures(run, but=broken.id), _failures(run, but=broken.id)
    assert {r["status"] for r in run.rows} <= {"ok", "skip", "FAIL"}
    assert run.returncode == 1, run.stderr


@pytest.mark.slow
def test_the_slow_plugin_is_measured_at_its_import_time(kit: Callable[..., KitRun]) -> None:
    """import_cost reports the hooks module's 2.5 s sleep, not a fraction of it."""
    detail = kit("kit-slow", "--import-budget", "1.0").by_id()["import_cost"]["detail"]
    took = re.search(r"took (\d+\.\d+) s", detail)
    assert took is not None, detail
    assert float(took.group(1)) >= 2.5
    assert "slowest module: kit_slow.hooks, " in detail  # where the time went, its own code's


@pytest.mark.slow
@pytest.mark.parametrize("item", ["rtpcore.models", "atom-plugin"])
def test_rtpcores_own_plugins_fail_nothing(kit: Callable[..., KitRun], item: str) -> None:
    """rtpcore's built-in plugin and atom-plugin pass every check that applies on the CPU (the
    kit's default device); graph_replay, a GPU check, is a skip saying so."""
    run = kit(item)
    assert not _failures(run), _failures(run)
    assert run.returncode == 0, run.stderr
    graph = [r for r in run.rows if r["check"] == "graph_replay"]
    assert graph
    assert all(r["status"] == "skip" and "CUDA" in r["detail"] for r in graph), graph


@pytest.mark.slow
def test_pytest_fails_exactly_the_broken_check(site: Path, pytester: pytest.Pytester,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``pytest -p rtpcore.testing.pytest_plugin --rtpcore-plugin kit-layout`` collects the kit's
    checks on it as items and fails only kv_layout[kit_int_fp8], showing its rule. (Entry-point
    plugins are not autoloaded: where rtpcore is installed its pytest11 entry point would register
    the same module a second time, under another name, which pytest refuses.)"""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "rtpcore.testing.pytest_plugin",
                                           "--rtpcore-plugin", "kit-layout", "-v")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "*kit-layout::registration PASSED*",
        "*kit-layout::import_cost PASSED*",
        "*kit-layout::no_patches PASSED*",
        "*kit-layout::kv_layout?kit_int_fp8? FAILED*",
    ])
    result.stdout.fnmatch_lines([f"*rule: {RULES['kv_layout']}*"])
