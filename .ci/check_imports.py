"""Check rtpcore's import graph: no cycle, and imports point down the data flow.

Every ``import`` of an ``rtpcore`` module counts, at module level or inside a
function (both run), except under ``if TYPE_CHECKING:`` (never runs). Stages, from
the bottom: errors, plugins, checkpoint, kv, parallel, models, engine, serving, cli; a
module may import its own stage and the stages below it. The package root and the
public compatibility modules (``rtpcore.batch``, ``rtpcore.layers``) only re-export
and sit on top: nothing inside rtpcore imports them.

    python .ci/check_imports.py [SRC]      # exit 1 and one line per violation
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

STAGES = ["errors", "plugins", "checkpoint", "kv", "parallel", "models", "engine", "serving", "cli"]
TOP = {"rtpcore", "rtpcore.__main__", "rtpcore.batch", "rtpcore.layers"}


def module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stage(module: str) -> int:
    if module in TOP:
        return len(STAGES)
    return STAGES.index(module.split(".")[1])


def imports(tree: ast.AST, module: str, known: set[str]) -> set[str]:
    """rtpcore modules ``tree`` imports at run time (TYPE_CHECKING blocks skipped)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != module}


def main(argv: list[str]) -> int:
    src = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[1] / "src")
    files = {module_name(src, p): p for p in (src / "rtpcore").rglob("*.py")}
    graph = {m: imports(ast.parse(p.read_text(), str(p)), m, set(files)) for m, p in files.items()}
    problems = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if d in TOP and m not in TOP:
                problems.append(f"{m} imports {d}, which only re-exports for users")
            elif stage(d) > stage(m):
                problems.append(f"{m} ({STAGES[stage(m)]}) imports {d} ({STAGES[stage(d)]}), up the data flow")
    # cycles: depth-first search over modules; a package imports its __init__ implicitly, ignore that
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if m.startswith(d + "."):  # a module importing its own package's __init__
                continue
            if state.get(d) == 1:
                problems.append("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            elif d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    for p in problems:
        print(p)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports: "
          f"{'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
