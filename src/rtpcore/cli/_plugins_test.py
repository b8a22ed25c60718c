"""``rtpcore plugins test ITEM``: the conformance kit (docs/design.md §19, ``rtpcore.testing.kit``).

Runs each check on everything the plugin registers and prints one line per check and subject
as it ends, pytest's way: the check's id, a dotted leader, ``ok``, ``FAIL`` or ``skip``, the
seconds it took and a short note; then every failure in full (the rule, what was seen) and a
summary line. ``--json`` prints a JSON array of ``{"check", "subject", "status", "seconds",
"detail"}`` instead. The exit status is 1 if any check fails, 2 for a malformed command.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

from rtpcore.cli._args import LOG_LEVELS
from rtpcore.plugins.allowlist import plugins_arg

__all__ = ["add_test_parser"]

_WIDTH = 78


def _check_name(text: str) -> str:
    from rtpcore.testing.kit import CHECKS

    if text not in CHECKS:
        raise argparse.ArgumentTypeError(f"unknown check {text!r}; the checks are: {', '.join(CHECKS)}")
    return text


def _item(text: str) -> str:
    """argparse type: one allowlist item (the allowlist's rules), or ``rtpcore.models``."""
    from rtpcore.testing.kit import BUILTIN_ITEM

    if text != BUILTIN_ITEM:
        items = plugins_arg(text)  # ArgumentTypeError naming the rule
        if len(items) != 1:
            raise argparse.ArgumentTypeError(f"{text!r}: the kit tests one plugin at a time")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_test_parser(actions: Any) -> None:
    tester = actions.add_parser(
        "test",
        help="run the conformance kit on a plugin: every check on every model and seam it registers",
        description="Run the conformance kit (docs/design.md §19) on ITEM: each check on the plugin and on each "
        "model, attention backend, quantization method, reasoning parser, logits processor and platform it "
        "registers, building random checkpoints from each model's demo_config(). Each check is ok, FAIL (the "
        "rule and what was seen) or skip (why: e.g. a GPU check on a CPU). Exit status 1 if any fails. ITEM "
        "'rtpcore.models' tests rtpcore's built-in plugin.",
    )
    tester.add_argument("item", metavar="ITEM", type=_item,
                        help="the plugin, as --plugins names it: DIST[:ENTRY_POINT][SPECIFIER], or rtpcore.models")
    tester.add_argument("--json", action="store_true", help="print a JSON array of the results")
    tester.add_argument("--check", dest="checks", action="extend", nargs="+", type=_check_name, default=[],
                        metavar="CHECK", help="run only these checks (repeatable; default: every check)")
    tester.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the engines of the checks run (default: %(default)s)")
    tester.add_argument("--import-budget", type=_seconds, default=1.0, metavar="SECONDS",
                        help="import_cost's budget for importing the plugin and running its hooks "
                        "(default: %(default)s)")
    tester.add_argument("--log-level", choices=LOG_LEVELS, default="warning", type=str.lower,
                        help="the least severe of rtpcore's log records shown on stderr (default: %(default)s)")
    tester.set_defaults(func=_test)


def _test(args: argparse.Namespace) -> int:
    from rtpcore.testing.kit import plan_checks

    start = time.perf_counter()
    planned = plan_checks(args.item, checks=args.checks or None, device=args.device,
                          import_budget=args.import_budget)
    context = planned[0].context if planned else None
    if not args.json:
        _header(args, context, len(planned))
    results = []
    for check in planned:
        result = check.run()
        results.append(result)
        if not args.json:
            _line(result)
    if args.json:
        print(json.dumps([r.as_json() for r in results], indent=2))
    else:
        _footer(results, time.perf_counter() - start)
    return 1 if any(r.status == "FAIL" for r in results) else 0


def _rule(title: str, fill: str = "=") -> str:
    title = f" {title} " if title else ""
    left = max((_WIDTH - len(title)) // 2, 3)
    return f"{fill * left}{title}{fill * max(_WIDTH - left - len(title), 3)}"


def _header(args: argparse.Namespace, context: Any, count: int) -> None:
    import torch

    from rtpcore.plugins.loading import builtin_version

    print(_rule("rtpcore plugin conformance"))
    print(f"platform {sys.platform} -- Python {platform.python_version()}, rtpcore {builtin_version()}, "
          f"torch {torch.__version__}, device {args.device}")
    if context is not None:
        version = f" {context.version}" if context.version else ""
        print(f"plugin {context.name} ({context.distribution}{version}), state {context.outcome.state}")
    print(f"collected {count} check{'s' if count != 1 else ''}\n")
    sys.stdout.flush()


def _line(result: Any) -> None:
    note = result.detail.splitlines()[0] if result.detail and result.status != "FAIL" else ""
    head = f"{result.id} "
    status = {"ok": "ok", "FAIL": "FAIL", "skip": "skip"}[result.status]
    dots = "." * max(_WIDTH - 24 - len(head), 3)
    line = f"{head}{dots} {status:<4} {result.seconds:6.2f}s"
    if note:
        line += f"  {note if len(note) <= 90 else note[:89] + '…'}"  # --json has it whole
    print(line)
    sys.stdout.flush()


def _footer(results: list[Any], seconds: float) -> None:
    failed = [r for r in results if r.status == "FAIL"]
    if failed:
        print("\n" + _rule("FAILURES"))
        for r in failed:
            print(_rule(r.id, "_"))
            print(r.detail)
    counts = [(sum(r.status == s for r in results), word) for s, word in
              (("FAIL", "failed"), ("ok", "passed"), ("skip", "skipped"))]
    summary = ", ".join(f"{n} {word}" for n, word in counts if n) or "no checks"
    print("\n" + _rule(f"{summary} in {seconds:.1f}s"))
