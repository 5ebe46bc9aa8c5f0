"""The package's layers hold: no import cycles between its modules, no import against the layering, no private
name imported by the tests.

Every import counts, at the top of a module or inside a function (a lazy import is still a dependency, and a
cycle through one breaks as soon as someone hoists it). The layers, from the bottom:

  plugins   the tree-attention kernels and TensorRT plugin (and ``runtime.errors``: every user error's base)
  runtime   the engine step, backends, drafting and the loop
  exporter  tracing, quantizing and checking engines
  serving   the OpenAI and Triton servers (run exported engines: runtime only)
  training  the heads' training (exports and checks with the exporter)
  bench     benchmarks against peers (load models with the exporter)
  cli       the commands: anything
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the package's folder (the repository root is medusa_trt)
PACKAGE = "medusa_trt"
# what each package may import besides itself
ALLOWED = {
    "plugins": {"runtime.errors"},
    "runtime": {"plugins"},
    "exporter": {"runtime", "plugins"},
    "serving": {"runtime", "plugins"},
    "training": {"exporter", "runtime", "plugins"},
    "bench": {"exporter", "runtime", "plugins"},
    "cli": {"serving", "training", "bench", "exporter", "runtime", "plugins"},
}


def modules(root: Path, packages) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name (``medusa_trt.runtime.engine``) -> file."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((PACKAGE, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known) -> set[str]:
    """The modules of ``known`` that the module ``name`` at ``path`` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:  # from a package import a module, or names of the module itself
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph(root: Path, packages) -> dict[str, set[str]]:
    known = modules(root, packages)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start), on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def wrong_way(edges: dict[str, set[str]]) -> list[str]:
    """Imports against ``ALLOWED``: ``a -> b`` where a's package may not import b."""

    def allowed(importer: str, imported: str) -> bool:
        mine, theirs = importer.split(".")[1], imported.split(".")[1]
        rules = ALLOWED[mine] | {mine}
        return theirs in rules or imported.removeprefix(PACKAGE + ".") in rules

    return sorted(f"{a} -> {b}" for a, deps in edges.items() for b in deps if not allowed(a, b))


def test_no_module_imports_itself_round_a_cycle():
    found = cycles(graph(ROOT, ALLOWED))
    assert not found, "import cycles (break them: move the shared name down a layer): " + "; ".join(" <-> ".join(c) for c in found)


def test_every_import_follows_the_layers():
    assert not wrong_way(graph(ROOT, ALLOWED))


def test_the_tests_import_no_private_name():
    private = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not private, private


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_checks_find_a_cycle_through_a_lazy_import_and_a_wrong_way_import(tmp_path):
    root = _package(
        tmp_path,
        {
            "runtime/__init__.py": "",
            "runtime/a.py": "from medusa_trt.runtime.b import X\n",
            "runtime/b.py": "def f():\n    from medusa_trt.runtime import a\nX = 1\n",
            "runtime/c.py": "from medusa_trt.exporter.d import Y\nfrom .a import X\n",
            "exporter/__init__.py": "",
            "exporter/d.py": "from medusa_trt.runtime import c\nY = 2\n",
        },
    )
    edges = graph(root, ("runtime", "exporter"))
    assert edges["medusa_trt.runtime.c"] == {"medusa_trt.exporter.d", "medusa_trt.runtime.a"}  # relative imports resolved
    assert cycles(edges) == [["medusa_trt.runtime.a", "medusa_trt.runtime.b"], ["medusa_trt.exporter.d", "medusa_trt.runtime.c"]]
    assert wrong_way(edges) == ["medusa_trt.runtime.c -> medusa_trt.exporter.d"]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_is_read(package):
    """Each layer has modules and the graph sees imports in it (a path mistake would pass the checks above vacuously)."""
    edges = graph(ROOT, ALLOWED)
    mine = [m for m in edges if m.split(".")[1] == package]
    assert len(mine) >= 2 and any(edges[m] for m in mine), package


def test_the_successor_cap_is_one_number():
    """The exporter's --successors range, the native step's check and its C ranking buffers: one cap."""
    import re

    from medusa_trt.runtime import native_step
    from medusa_trt.runtime.contract import MAX_SUCCESSORS

    defined = re.search(r"^#define MAX_TOPK (\d+)", (ROOT / "runtime" / "native_step.c").read_text(), re.M)
    assert defined and int(defined.group(1)) == MAX_SUCCESSORS == native_step.MAX_TOPK
