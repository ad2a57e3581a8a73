"""``python -m launch``: the entry points, one line each (``python -m launch.NAME --help`` for more)."""

from __future__ import annotations

import ast
from pathlib import Path


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``"""
    test = node.test if isinstance(node, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and [getattr(c, "value", None) for c in test.comparators] == ["__main__"]
    )


def entry_points() -> dict[str, str]:
    """{name: first docstring line} of every launch module that runs as ``python -m launch.NAME``
    (it has a ``__main__`` guard: helpers such as ``processes`` are not listed), read without
    importing it (no JAX start-up)."""
    out = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        module = ast.parse(path.read_text())
        if path.stem.startswith("_") or not any(_is_main_guard(node) for node in module.body):
            continue
        doc = ast.get_docstring(module) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        out[path.stem] = first.split(": ``")[0].rstrip(".")  # "Evaluate a run: ``usage``" -> "Evaluate a run"
    return out


def main() -> None:
    points = entry_points()
    width = max(map(len, points))
    print("fibjax entry points (python -m launch.NAME --help for each one's options):")
    for name, line in points.items():
        print(f"  {name:<{width}}  {line}")


if __name__ == "__main__":
    main()
