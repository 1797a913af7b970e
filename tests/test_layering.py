"""The package's tiers (schemoe/tiers.py, quoted by docs/architecture.md): imports point down
only, function-level imports included, and `import schemoe` loads no planning, tuning or tool
module. `python tests/test_layering.py` prints the tree: folders, modules, lines, and the import
edges between folders."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from schemoe.tiers import TIERS, tier_of

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "schemoe"


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


MODS = _modules()
EDGES = {m: _imports(m, p, MODS) for m, p in MODS.items()}


def _top(mod: str) -> str:
    """The folder (or root module) a module belongs to."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def tree() -> str:
    """The package as a table: each folder (or root module) with its tier, module count and
    lines, then the import edges between folders (how many imports cross each)."""
    mods, lines = Counter(), Counter()
    for m, p in MODS.items():
        mods[_top(m)] += 1
        lines[_top(m)] += len(p.read_text().splitlines())
    out = [f"{'folder':14} {'tier':10} {'modules':>7} {'lines':>6}"]
    for top in sorted(mods, key=lambda t: (tier_of(f"schemoe.{t}") if t != "__init__" else 3, t)):
        tier = TIERS[tier_of(f"schemoe.{top}") if top != "__init__" else 3][0]
        out.append(f"{top:14} {tier:10} {mods[top]:7d} {lines[top]:6d}")
    root = sum(1 for m in MODS if m.count(".") <= 1 and MODS[m].parent == PKG)
    out.append(f"total: {len(MODS)} modules, {sum(lines.values())} lines, {root} at the root")
    cross = Counter((_top(m), _top(t)) for m, ts in EDGES.items() for t in ts if _top(m) != _top(t))
    out.append("imports between folders (from -> to: count):")
    out += [f"  {a} -> {b}: {n}" for (a, b), n in sorted(cross.items())]
    return "\n".join(out)


def test_every_module_belongs_to_a_tier():
    unknown = []
    for m in MODS:
        try:
            tier_of(m)
        except ValueError:
            unknown.append(m)
    assert unknown == []


@pytest.mark.parametrize("mod", sorted(m for m in MODS if m != "schemoe"))
def test_a_module_imports_only_from_its_tier_or_below(mod):
    up = sorted(t for t in EDGES[mod] if t != "schemoe" and tier_of(t) > tier_of(mod))
    assert up == [], f"{mod} ({TIERS[tier_of(mod)][0]}) imports upward: {up}"


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
    layer = [m for m in MODS if _top(m) == "layer"]
    bad = sorted(t for m in layer for t in EDGES[m] if _top(t) in ("costmodel", "tuning"))
    assert bad == []


def test_the_package_root_keeps_at_most_eight_modules():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 8, root


def test_import_schemoe_loads_no_planning_tuning_or_tool_module():
    code = (
        "import sys, schemoe; print(sorted(m for m in sys.modules if m.startswith('schemoe.') "
        "and m.split('.')[1] in ('costmodel', 'tuning', 'profile', 'bench', 'testbed', 'cli', "
        "'train')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


if __name__ == "__main__":
    print(tree())
