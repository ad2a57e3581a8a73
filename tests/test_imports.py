"""The package layering, read from the source (every import, at any depth, except those under
``if TYPE_CHECKING:``): no two packages import each other, even through others; evaluation
imports nothing from training; the run directory's package sits below training, evaluation and
decoding; the attention library and the model import none of them."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "fibjax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """fibjax.train.loop -> train; fibjax.model -> model; fibjax -> fibjax."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _type_checking_only(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[str]:
    """Every fibjax module ``tree`` imports (``from fibjax import data`` counts as fibjax.data)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking_only(node):
            found += [name for child in node.orelse for name in _imports(ast.Module(body=[child], type_ignores=[]))]
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] if node.module != "fibjax" else [f"fibjax.{a.name}" for a in node.names]
        found += _imports(node)
    return [name for name in found if name == "fibjax" or name.startswith("fibjax.")]


def package_imports() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the modules of the first that import the second."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        for name in _imports(ast.parse(path.read_text(), str(path))):
            if _package(name) != _package(module):
                edges[_package(module)][_package(name)].append(module)
    return edges


def _cycle(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of packages (first package repeated at the end), or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in edges.get(node, {}):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    return next((c for start in list(edges) if start not in state for c in [visit(start, [start])] if c), None)


def test_the_walk_sees_imports_at_any_depth_and_skips_type_checking_ones():
    source = """
import fibjax.model
from fibjax import data as data_lib, distributed
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from fibjax.train import loop
else:
    import fibjax.kinds
def f():
    from fibjax.run.load import load_run
"""
    assert sorted(_imports(ast.parse(source))) == ["fibjax.data", "fibjax.distributed", "fibjax.kinds", "fibjax.model", "fibjax.run.load"]
    assert _cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": []}, "b": {"c": []}, "d": {"a": []}}) is None


def test_no_two_packages_import_each_other():
    edges = package_imports()
    cycle = _cycle(edges)
    where = [f"{a} -> {b} in {sorted(set(edges[a][b]))}" for a, b in zip(cycle, cycle[1:], strict=False)] if cycle else []
    assert cycle is None, "packages import each other: " + "; ".join(where)


def test_evaluation_imports_nothing_from_training():
    assert "train" not in package_imports()["eval"], package_imports()["eval"]["train"]


def test_the_run_directory_sits_below_training_evaluation_and_decoding():
    edges = package_imports()
    for low in ("attention", "kinds", "model", "config", "data", "run", "sharding"):
        above = {"run", "train", "eval", "decode", "probe", "bench", "study", "plan"} - {low}
        assert not above & set(edges[low]), f"{low} imports {sorted(above & set(edges[low]))}: {dict(edges[low])}"
    for high in ("train", "eval", "decode"):
        assert "run" in edges[high], f"{high} should load runs through fibjax.run"
