"""The architecture the design promises, held by the code itself: no import cycle
(counting ``TYPE_CHECKING`` and function-local imports), no arrow from the sinks into the
record, a package root of vocabulary and public API only, and the engine reached through
its façade alone."""

from __future__ import annotations

import ast
from pathlib import Path

import stethoscope

SRC = Path(stethoscope.__file__).resolve().parent
#: The package root: the vocabulary every part speaks, and the public API (the
#: statistics' declarations are a package of their own there).
ROOT = {
    "advice",
    "cli",
    "findings",
    "number_formats",
    "observation",
    "prints",
    "running_statistics",
    "summary",
    "testing",
}
#: What the engine shows the rest of the package (its ``__init__``): the façade, the
#: decisions it returns and the settings it is made from.
FACADE = {"Decision", "Monitor", "Settings", "StopOn"}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(SRC.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """Every stethoscope module ``name`` imports, wherever the import stands, with the
    names it takes from it and the line."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            found.append((base, [a.name for a in node.names], node.lineno))
    out = []
    for target, names, line in found:
        # ``from package import module`` imports the module
        for candidate in [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]:
            out.append((candidate, [], line))
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append((target, names, line))
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(m)} for m in MODULES}


def _related(a: str, b: str) -> bool:
    """A package and its own module (its ``__init__`` re-exports what the module holds)."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def test_no_import_cycle():
    graph = _graph()
    # strongly connected components (Tarjan), iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                designed = all(any(_related(x, y) for y in component if y != x) for x in component)
                if len(component) > 1 and not designed:
                    cycles.append(sorted(component))
    assert cycles == []


def test_the_sinks_never_import_the_record():
    arrows = [
        (m, t, line)
        for m in MODULES
        if m.startswith("stethoscope.sinks")
        for t, _, line in _imports(m)
        if t.startswith("stethoscope.record")
    ]
    assert arrows == [], "a sink reaches the record through RunContext.report"


def test_the_package_root_holds_the_vocabulary_and_the_public_api():
    root = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    assert root == ROOT


def test_the_engine_is_reached_through_its_facade():
    reaching = [
        f"{m}:{line} imports {t}"
        for m in MODULES
        if not m.startswith("stethoscope.engine")
        for t, names, line in _imports(m)
        if t.startswith("stethoscope.engine.")
        or (t == "stethoscope.engine" and set(names) - FACADE)
    ]
    assert reaching == []


def test_nothing_reaches_through_the_monitor_into_its_parts():
    chains = []
    for m, path in MODULES.items():
        if m.startswith("stethoscope.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)):
                continue
            base = node.value.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if name in ("monitor", "_monitor"):
                chains.append(f"{m}:{node.lineno} {name}.{node.value.attr}.{node.attr}")
    assert chains == []
