"""Check rtpcore's import graph: no cycle, and imports point down the data flow.

Every ``import`` of an ``rtpcore`` module counts, at module level, inside a function (both
run) or under ``if TYPE_CHECKING:`` (a type-only import that closes a loop is a loop:
docs/design.md §7). Stages, from the bottom: errors, config_fields, plugins, reasoning, logits, checkpoint, kv,
parallel, models, engine, serving, testing, cli; a module may import its own stage and the stages below it.
Inside engine/ the same holds for its parts, from the bottom: sample/, core/, step/, worker/,
text/, then the modules at engine/'s top (engine_core, config, engine, async_engine), which may
import every part. The package root and the public compatibility modules (``rtpcore.batch``,
``rtpcore.layers``, ``rtpcore.sharding``) only re-export and sit on top: nothing inside rtpcore imports them.

    python .ci/check_imports.py [SRC [PACKAGE]]   # exit 1 and one line per violation

With a PACKAGE other than rtpcore (``plugins_example/atom_plugin/src atom_plugin``) only
cycles are checked.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

STAGES = ["errors", "config_fields", "plugins", "reasoning", "logits", "checkpoint", "quantization", "kv", "parallel", "attention", "platforms", "models", "engine", "serving",
          "testing", "cli"]
ENGINE_PARTS = ["sample", "core", "step", "worker", "text"]  # then engine/'s own top modules
TOP = {"rtpcore", "rtpcore.__main__", "rtpcore.batch", "rtpcore.layers", "rtpcore.sharding"}


def module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stage(module: str) -> int:
    if module in TOP:
        return len(STAGES)
    return STAGES.index(module.split(".")[1])


def engine_part(module: str) -> int:
    """The rank of an engine module's part (sample/ lowest); engine/'s top modules above them all."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[2] in ENGINE_PARTS:
        return ENGINE_PARTS.index(parts[2])
    return len(ENGINE_PARTS)


def part_name(module: str) -> str:
    rank = engine_part(module)
    return f"engine/{ENGINE_PARTS[rank]}" if rank < len(ENGINE_PARTS) else "engine/ (top)"


def imports(tree: ast.AST, module: str, known: set[str]) -> set[str]:
    """rtpcore modules ``tree`` imports, run-time and type-only alike."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & known
            if len(submodules) < len(node.names):  # a name from the module itself
                found.add(node.module)
            found.update(submodules)  # `from pkg import module` imports that module, not pkg's names
    return {m for m in found if m in known and m != module}


def main(argv: list[str]) -> int:
    src = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[1] / "src")
    package = argv[2] if len(argv) > 2 else "rtpcore"  # another package (a plugin's): cycles only
    files = {module_name(src, p): p for p in (src / package).rglob("*.py")}
    graph = {m: imports(ast.parse(p.read_text(), str(p)), m, set(files)) for m, p in files.items()}
    problems = []
    for m, deps in sorted(graph.items()):
        if package != "rtpcore":
            break
        for d in sorted(deps):
            if d in TOP and m not in TOP:
                problems.append(f"{m} imports {d}, which only re-exports for users")
            elif stage(d) > stage(m):
                problems.append(f"{m} ({STAGES[stage(m)]}) imports {d} ({STAGES[stage(d)]}), up the data flow")
            elif (stage(d) == stage(m) == STAGES.index("engine") and d != "rtpcore.engine"
                  and engine_part(d) > engine_part(m)):
                problems.append(f"{m} ({part_name(m)}) imports {d} ({part_name(d)}), up the engine's parts")
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
