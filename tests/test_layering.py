"""The package's layers (docs/architecture.md): imports point down only, function-level imports
included, and `import schemoe` loads no planning layer, tuner or tool."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "schemoe"

# Bottom up. A module may import from its own layer or any layer below.
LAYERS = [
    ("parts", ["config", "registry", "devices", "topology", "trace", "gating", "layout", "experts",
               "collectives", "compression", "_cli_util", "links", "timing"]),  # _cli_util: a leaf
    ("scheduling", ["scheduling"]),
    ("planning", ["costmodel"]),
    ("layer", ["dispatcher", "region", "layer", "stack_runtime", "stack", "probe", "planning", "autotune", "automicro", "parallel"]),
    ("training", ["gradsync", "lm", "train", "train_resume", "train_report", "train_args", "checkpoint_files", "_lifeline", "checkpoint", "hf", "failures", "testing", "_dist"]),
    ("tools", ["profiler", "bench", "testbed", "cli", "__main__"]),
]  # fmt: skip
LEVEL = {top: i for i, (_, tops) in enumerate(LAYERS) for top in tops}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """schemoe modules `name` imports anywhere in its file (functions included)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t.startswith("schemoe") and t != name:
                found.add(t)
    return found


def _level(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) == 1:  # the package itself: the public API, at the layer level
        return LEVEL["layer"]
    return LEVEL[parts[1]]


MODS = _modules()
EDGES = {m: _imports(m, p, MODS) for m, p in MODS.items()}


def test_every_module_belongs_to_a_layer():
    unknown = [m for m in MODS if m != "schemoe" and m.split(".")[1] not in LEVEL]
    assert unknown == []


@pytest.mark.parametrize("mod", sorted(m for m in MODS if m != "schemoe"))
def test_a_module_imports_only_from_its_layer_or_below(mod):
    up = sorted(t for t in EDGES[mod] if t != "schemoe" and _level(t) > _level(mod))
    assert up == [], f"{mod} ({LAYERS[_level(mod)][0]}) imports upward: {up}"


def test_the_import_graph_has_no_cycle():
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m) :] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(EDGES.get(m, ())):
            if t != "schemoe":  # the package's own __init__ re-exports only
                visit(t)
        stack.pop()

    for m in sorted(MODS):
        visit(m)
    assert cycles == []


def test_the_layer_imports_nothing_from_the_cost_model_or_the_tuner():
    bad = [
        t
        for t in EDGES["schemoe.layer"]
        if any(m in t for m in ("costmodel", "planning", "autotune"))
    ]
    assert bad == []


def test_import_schemoe_loads_no_planning_layer_tuner_or_tool():
    code = (
        "import sys, schemoe; print(sorted(m for m in sys.modules if m.startswith('schemoe.') "
        "and m.split('.')[1] in ('costmodel', 'planning', 'autotune', 'probe', 'profiler', 'bench', 'testbed', "
        "'cli')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
