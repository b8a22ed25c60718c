"""rtpcore's pytest plugin (the ``pytest11`` entry point ``rtpcore``): the conformance kit as pytest items.

``pytest --rtpcore-plugin ITEM`` collects one item per check and subject of the kit
(``rtpcore.testing.kit``), named as ``rtpcore plugins test`` names them (``registration``,
``batch_invariance[my_model]``), so ``-k`` selects them. Given only ``--rtpcore-plugin`` (no test
paths on the command line), pytest runs the kit alone; with paths, the kit's items join the
tests collected there. A failed check shows its rule and what was seen, not a traceback through
rtpcore; a check that does not apply is a skip with its reason.

For a plugin's own tests, the ``rtpcore_kit`` fixture runs one check on demand::

    def test_my_model_batches(rtpcore_kit):
        rtpcore_kit("batch_invariance", "my_model", item="my-plugin")  # fails or skips the test

Options: ``--rtpcore-plugin ITEM`` (repeatable), ``--rtpcore-device cpu|cuda``,
``--rtpcore-import-budget SECONDS``. Importing this module imports neither torch nor the kit:
the plugin is loaded by every pytest run where rtpcore is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["rtpcore_kit"]


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("rtpcore", "rtpcore conformance kit (docs/design.md §19)")
    group.addoption("--rtpcore-plugin", action="append", default=[], metavar="ITEM",
                    help="run the conformance kit on this plugin (an allowlist item, or rtpcore.models); repeatable")
    group.addoption("--rtpcore-device", default="cpu", choices=("cpu", "cuda"),
                    help="where the kit's engines run (default: cpu)")
    group.addoption("--rtpcore-import-budget", type=float, default=1.0, metavar="SECONDS",
                    help="import_cost's budget (default: 1.0)")


class KitItem(pytest.Item):
    """One check of the kit on one subject."""

    def __init__(self, *, planned: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.planned = planned

    def runtest(self) -> None:
        result = self.planned.run()
        if result.status == "skip":
            pytest.skip(result.detail)
        if result.status == "FAIL":
            raise KitFailure(result.detail)

    def repr_failure(self, excinfo: Any, style: Any = None) -> Any:
        if isinstance(excinfo.value, KitFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"rtpcore kit: {self.name}"


class KitFailure(Exception):
    """A kit check's failure (its detail is the report)."""


def pytest_ignore_collect(collection_path: Any, config: Any) -> bool | None:
    """With --rtpcore-plugin and no test paths on the command line, no file is collected."""
    if config.getoption("rtpcore_plugin") and config.args_source != pytest.Config.ArgsSource.ARGS:
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: they apply to the kit's items too
def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    wanted = config.getoption("rtpcore_plugin")
    if not wanted:
        return
    from rtpcore.testing.kit import plan_checks

    kit_items = []
    for item in wanted:
        planned = plan_checks(item, device=config.getoption("rtpcore_device"),
                              import_budget=config.getoption("rtpcore_import_budget"))
        kit_items += [KitItem.from_parent(session, name=p.id, nodeid=f"{item}::{p.id}", planned=p)
                      for p in planned]
    if config.args_source != pytest.Config.ArgsSource.ARGS:  # no test paths given: the kit alone
        items[:] = []
    items.extend(kit_items)


@pytest.fixture(scope="session")
def rtpcore_kit(request: Any) -> Callable[..., Any]:
    """``rtpcore_kit(check, subject=None, *, item=None)``: run one kit check; a failure fails the
    test (its rule and what was seen), a check that does not apply skips it. ``item``: the
    plugin (default: the first ``--rtpcore-plugin``)."""
    contexts: dict[str, Any] = {}

    def run(check: str, subject: str | None = None, *, item: str | None = None) -> Any:
        from rtpcore.testing.kit import KitContext, PlannedCheck

        name = item or next(iter(request.config.getoption("rtpcore_plugin")), None)
        if name is None:
            raise ValueError("rtpcore_kit: give item= or run pytest with --rtpcore-plugin ITEM")
        if name not in contexts:
            contexts[name] = KitContext(name, device=request.config.getoption("rtpcore_device"),
                                        import_budget=request.config.getoption("rtpcore_import_budget"))
        result = PlannedCheck(check, subject, contexts[name]).run()
        if result.status == "skip":
            pytest.skip(result.detail)
        if result.status == "FAIL":
            pytest.fail(result.detail, pytrace=False)
        return result

    return run
