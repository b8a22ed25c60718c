"""What a plugin's own tests use (docs/design.md §19, §21): demo checkpoints and the conformance kit.

:func:`demo_checkpoint` builds (once, then from the cache) a small, deterministic, random-weight
checkpoint of any model type whose plugin has a ``demo_config()``: a plugin's test gets a real
checkpoint folder without a download. :func:`ensure_demo_checkpoint` does the same for a plugin
object in hand, and :func:`demo_cache_dir` says where they are kept.

The conformance kit (``rtpcore plugins test ITEM``; ``pytest --rtpcore-plugin ITEM``, and the
``rtpcore_kit`` fixture, through rtpcore's pytest plugin): :func:`run_kit` runs every check on a
plugin, :func:`plan_checks` lists them as :class:`PlannedCheck` objects, :func:`run_check` runs one
on a plugin's own model and prompts and raises :class:`CheckFailed` (an AssertionError) or
:class:`CheckSkipped` (a unittest.SkipTest, which pytest reports as a skip); each result is a
:class:`CheckResult`. :data:`CHECKS` names the checks and :data:`RULES` gives each one's rule.
"""

from rtpcore.testing.demo import demo_cache_dir, demo_checkpoint, ensure_demo_checkpoint
from rtpcore.testing.kit import (
    CHECKS,
    RULES,
    CheckFailed,
    CheckResult,
    CheckSkipped,
    KitContext,
    PlannedCheck,
    plan_checks,
    run_check,
    run_kit,
)

__all__ = [
    "CHECKS",
    "RULES",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "KitContext",
    "PlannedCheck",
    "demo_cache_dir",
    "demo_checkpoint",
    "ensure_demo_checkpoint",
    "plan_checks",
    "run_check",
    "run_kit",
]
