"""No two fibjax modules import each other, directly or through others. Every import counts, a
function's own included (the tokenizer modules' old circle ran through one: the interface
imported both implementations inside ``load_tokenizer``), except those under
``if TYPE_CHECKING:``; ``from fibjax.a import b`` is an import of ``fibjax.a.b`` when that is a
module, else of ``fibjax.a``. tests/test_imports.py checks the same between packages; this test
is per module."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the package directory ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _import_statements(node: ast.AST):
    """Every import statement under ``node``, at any depth, except under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
            for statement in child.orelse:
                yield from _import_statements(ast.Module(body=[statement], type_ignores=[]))
        else:
            yield from _import_statements(child)


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _import_statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {name for name in found if name in known and name != module}


def cycles(root: Path) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), sorted."""
    files = module_names(root)
    edges = {m: sorted(imports_of(m, p, set(files))) for m, p in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in edges[node]:
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
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

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(groups)


def test_no_fibjax_modules_import_each_other_in_a_circle():
    assert len(module_names(ROOT / "fibjax")) > 100  # the walk found the package
    assert cycles(ROOT / "fibjax") == []


def test_the_tokenizer_modules_old_circle_is_found(tmp_path):
    """fibjax 0.1.0's data/tokenizer.py, cut to its imports: load_tokenizer imported both
    implementations, and each of them (and special_tokens) imported the interface."""
    body = "from fibjax.data.special_tokens import resolve\nfrom fibjax.data.tokenizer import Tokenizer\n"
    root = _tree(
        tmp_path,
        {
            "fibjax/__init__.py": "",
            "fibjax/data/__init__.py": "from fibjax.data.tokenizer import load_tokenizer\n",
            "fibjax/data/tokenizer.py": "def load_tokenizer(path):\n    from fibjax.data import hf_tokenizer, sentencepiece_tokenizer\n",
            "fibjax/data/hf_tokenizer.py": body,
            "fibjax/data/sentencepiece_tokenizer.py": body,
            "fibjax/data/special_tokens.py": "from fibjax.data.tokenizer import TokenizerError\n",
        },
    )
    modules = ["fibjax.data.hf_tokenizer", "fibjax.data.sentencepiece_tokenizer", "fibjax.data.special_tokens", "fibjax.data.tokenizer"]
    assert cycles(root) == [modules]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path / next(iter(files)).split("/")[0]


def test_a_circle_through_a_third_module_is_found(tmp_path):
    """``from pkg.data import impl`` is an import of the module pkg.data.impl; relative imports
    resolve against the package."""
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/data/__init__.py": "",
            "pkg/data/base.py": "from pkg.data import impl\n",
            "pkg/data/impl.py": "from . import helper\n",
            "pkg/data/helper.py": "import pkg.data.base\n",
            "pkg/data/other.py": "from pkg.data.base import X\n",
        },
    )
    assert cycles(root) == [["pkg.data.base", "pkg.data.helper", "pkg.data.impl"]]


def test_imports_inside_functions_are_edges_and_type_checking_ones_are_not(tmp_path):
    root = _tree(
        tmp_path,
        {"pkg/__init__.py": "", "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n", "pkg/b.py": "import pkg.a\n"},
    )
    assert cycles(root) == []
    (root / "a.py").write_text("def f():\n    try:\n        from pkg.b import g\n    except ImportError:\n        pass\n")
    assert cycles(root) == [["pkg.a", "pkg.b"]]
