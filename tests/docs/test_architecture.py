"""The house as docs/architecture.md draws it, checked from the code: the layers of the package, what each may
import, no import circle, no file over 500 lines, every module in the architecture's table."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_hybrid"
#: What each part may import from the package (its own part always). The floor imports only itself; the runtime
#: (processes, ports, errors) only the floor; each dimension of the wing only the floor and the runtime -- never
#: another dimension; nothing below the composition imports it, the strategy or the recipes.
ALLOWED = {
    "core": {"core"},
    "runtime": {"core", "runtime"},
    "parallel": {"core", "runtime"},
}
ABOVE_THE_WING = {"parallelize", "options", "grad_sync", "steps", "strategy", "strategy_checkpoints", "mesh_strategy",
                  "runs", "checks"}


@functools.cache
def modules() -> dict[str, Path]:
    return {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
            for path in PACKAGE.rglob("*.py")}


def imports(path: Path, name: str, top_level: bool = False) -> set[str]:
    """The package modules ``path`` (module ``name``) imports: at import time or inside functions, or at import time
    only (``top_level``: its module-level import statements, ``TYPE_CHECKING`` blocks aside)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("lightning_hybrid"):
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("lightning_hybrid"))
    return found & set(modules())


def part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def dimension(module: str) -> str:
    """``lightning_hybrid.parallel.tensor_parallel.layers`` -> ``tensor_parallel``."""
    return module.split(".")[2]


def test_each_layer_imports_only_what_is_below_it_and_no_dimension_imports_another():
    wrong = []
    for name, path in modules().items():
        for target in imports(path, name):
            source_part, target_part = part(name), part(target)
            if source_part in ALLOWED and target_part not in ALLOWED[source_part] | {source_part}:
                wrong.append(f"{name} -> {target}")
            if source_part == "parallel" == target_part and name.count(".") > 1 and target.count(".") > 1 \
                    and dimension(name) != dimension(target):
                wrong.append(f"{name} -> {target} (one dimension into another)")
            if source_part in ("core", "runtime", "parallel") and target_part in ABOVE_THE_WING:
                wrong.append(f"{name} -> {target} (an arrow back up)")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_back_through_others():
    """No import circle among the modules' top-level imports (``TYPE_CHECKING`` and function-level ones aside)."""
    graph = {name: {t for t in imports(path, name, top_level=True) if t != name} for name, path in modules().items()}
    for name in graph:  # a package's __init__ re-exporting its modules is no circle of theirs
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_no_package_file_is_over_500_lines_and_no_test_file_over_600():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) >
    500]
    long += [f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / "tests").rglob("*.py")
             if (n := len(p.read_text().splitlines())) > 600]
    assert not long, long


def test_the_strategy_names_no_dimension():
    """`HybridStrategy` adapts Lightning: it calls `parallelize`, the steps and the dimensions' hooks, and imports
    nothing of the wing."""
    source = (PACKAGE / "strategy.py").read_text()
    assert not re.search(r"lightning_hybrid\.parallel\.", source)
    assert len(source.splitlines()) <= 300 and len((PACKAGE / "mesh_strategy.py").read_text().splitlines()) <= 300
    start = source.index("class HybridStrategy")
    end = source.find("\ndef ", start)
    assert len(source[start:end if end > 0 else None].splitlines()) <= 250


def test_every_module_is_in_the_architecture_table():
    table = (ROOT / "docs" / "architecture.md").read_text()
    paths = [str(path.relative_to(ROOT)) for name, path in modules().items() if not name.endswith("__main__")]
    missing = [p for p in paths if f"`{p}`" not in table and f"`{p.removesuffix('/__init__.py')}/`" not in table]
    assert not missing, missing
