"""The shape of the package, as its design promises it: no adapter names a concrete
sink, the framework-free core imports no framework, and no class or module outgrows
what a newcomer can read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import stethoscope.sinks

SRC = Path(stethoscope.sinks.__file__).resolve().parents[1]
MODULES = sorted(SRC.rglob("*.py"))
#: The built-in sink classes: only their own package may test for them.
CONCRETE_SINKS = {name for name in stethoscope.sinks.__all__ if name not in {"Sink", "RunContext"}}
#: The framework-free core (everything but the adapters).
CORE = [p for p in MODULES if "callbacks" not in p.relative_to(SRC).parts]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_isinstance_on_a_concrete_sink_outside_the_sinks(path):
    if "sinks" in path.relative_to(SRC).parts:
        return
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
            named = _names(node.args[1]) & CONCRETE_SINKS if len(node.args) == 2 else set()
            assert not named, f"{path.name}:{node.lineno} tests for {named}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_classes_and_modules_stay_readable(path):
    text = path.read_text()
    assert text.count("\n") <= 600, f"{path.name} has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= 400, f"{path.name}: class {node.name} has {size} lines"


def test_the_core_imports_no_framework():
    modules = [
        "stethoscope." + ".".join(p.relative_to(SRC).with_suffix("").parts)
        for p in CORE
        if p.name != "__init__.py"
    ]
    frameworks = ("torch", "tensorflow", "keras", "lightning")
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"print(sorted(m for m in {frameworks!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
