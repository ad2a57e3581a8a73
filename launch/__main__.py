"""``python -m launch``: the entry points, one line each (``python -m launch.NAME --help`` for more)."""

from __future__ import annotations

import ast
from pathlib import Path


def entry_points() -> dict[str, str]:
    """{name: first docstring line} of every launch module, read without importing it (no JAX start-up)."""
    out = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
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
