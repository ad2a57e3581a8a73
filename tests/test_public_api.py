"""fibjax's public surface is explicit and recorded: each package's ``__all__`` (the lazy ones
resolve every name), the API reference shows exactly it, and a change that breaks 0.1's surface
(a public name, parameter or method gone, a parameter made required or moved) fails unless
CHANGELOG.md announces it by name.

The record, tests/api/fibjax-0.1.json, is read from the source by griffe (the static analysis
behind the API reference): every public object's kind and signature, and a class's public
methods. After an announced break, write it again:

    python -m tests.test_public_api --write
"""

from __future__ import annotations

import importlib
import json
import re
import sys

import griffe
import pytest

from tests.helpers import ROOT

RECORD = ROOT / "tests" / "api" / "fibjax-0.1.json"
API_PAGE = ROOT / "docs" / "reference" / "api.md"
LAZY_PACKAGES = ["fibjax.train", "fibjax.eval", "fibjax.run"]
# packages whose names 0.1's record keeps under the modules that define them (fibjax.attention.api.dense_attention)
BY_HOME = ("attention", "kinds")


def package_all(name: str) -> list[str]:
    return list(getattr(importlib.import_module(name), "__all__", []))


def page_members() -> dict[str, list[str]]:
    """module -> the members the API page lists for it (``options: members: [...]``)."""
    text = API_PAGE.read_text()
    return {m[0]: [n.strip() for n in m[1].split(",")] for m in re.findall(r"^::: ([\w.]+)\n    options:\n      members: \[([^\]]*)\]", text, flags=re.M)}


def load() -> griffe.Object:
    return griffe.load("fibjax", search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)


def target(obj):
    return obj.final_target if isinstance(obj, griffe.Alias) else obj


def public_paths(package: griffe.Object) -> list[str]:
    """The dotted path of every public object: the packages' ``__all__`` and the modules the page lists."""
    import fibjax

    paths = []
    for sub in fibjax.__all__:
        module = importlib.import_module(f"fibjax.{sub}") if sub != "__version__" else None
        if module is not None and hasattr(module, "__path__"):
            names = package_all(f"fibjax.{sub}")
            paths += [target(package[f"{sub}.{name}"]).path if sub in BY_HOME else f"fibjax.{sub}.{name}" for name in names]
    paths += [f"{module}.{name}" for module, names in page_members().items() if module in ("fibjax.model", "fibjax.config") for name in names]
    return sorted(paths)


def test_lazy_packages_resolve_every_name_they_export():
    for name in LAZY_PACKAGES:
        module = importlib.import_module(name)
        assert sorted(module.__all__) == sorted(module._HOMES), name
        assert all(getattr(module, each) is not None for each in module.__all__)
        with pytest.raises(AttributeError, match="no attribute 'way_on'"):
            module.way_on  # noqa: B018


def test_the_api_page_shows_exactly_the_public_surface():
    """Packages are rendered whole (mkdocstrings shows their ``__all__``, the lazily loaded names
    through their ``if TYPE_CHECKING:`` imports); the modules model and config by the members listed."""
    text = API_PAGE.read_text()
    import fibjax

    whole = [f"fibjax.{sub}" for sub in fibjax.__all__ if sub not in ("__version__", "model", "config")]
    assert [p for p in whole if not re.search(rf"^::: {re.escape(p)}$", text, flags=re.M)] == []
    assert "way_on" not in text and "run_bounds" not in text


def signature(obj) -> dict:
    """What a caller relies on: kind, parameters (name, kind, has a default); a class's public methods."""
    obj = target(obj)
    if obj.is_function:
        return {"kind": "function", "parameters": [[p.name, p.kind.value, p.default is not None] for p in obj.parameters if p.name not in ("self", "cls")]}
    if obj.is_class:
        init = obj.members.get("__init__")
        members = {name: signature(m) for name, m in obj.members.items() if not name.startswith("_") and not isinstance(m, griffe.Alias) and m.is_function}
        return {"kind": "class", "parameters": signature(init)["parameters"] if init is not None and init.is_function else [], "methods": members}
    return {"kind": obj.kind.value}


def surface() -> dict:
    package = load()
    return {path: signature(package[path.removeprefix("fibjax.")]) for path in public_paths(package)}


def breaks(old: dict, new: dict, path: str = "") -> list[str]:
    """Each way ``new`` breaks a caller of ``old``."""
    found = []
    if old["kind"] != new["kind"]:
        return [f"{path}: was a {old['kind']}, now a {new['kind']}"]
    before = {p[0]: (i, p) for i, p in enumerate(old.get("parameters", []))}
    after = {p[0]: (i, p) for i, p in enumerate(new.get("parameters", []))}
    for name, (i, (_, kind, default)) in before.items():
        if name not in after:
            found.append(f"{path}: parameter {name} removed")
            continue
        j, (_, new_kind, new_default) = after[name]
        if new_kind != kind or (kind.startswith("positional") and i != j):
            found.append(f"{path}: parameter {name} moved or changed kind")
        if default and not new_default:
            found.append(f"{path}: parameter {name} now required")
    for name, (_, (_, kind, default)) in after.items():
        if name not in before and not default and "variadic" not in kind:
            found.append(f"{path}: new required parameter {name}")
    for name, method in old.get("methods", {}).items():
        found += [f"{path}.{name}: removed"] if name not in new.get("methods", {}) else breaks(method, new["methods"][name], f"{path}.{name}")
    return found


def test_no_unannounced_break_of_the_recorded_surface():
    old, new = json.loads(RECORD.read_text()), surface()
    problems = [f"{path}: removed" for path in old if path not in new]
    problems += [b for path in old if path in new for b in breaks(old[path], new[path], path)]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    unannounced = [p for p in problems if p.split(":")[0].rsplit(".", 1)[-1] not in changelog]
    assert unannounced == [], "announce each in CHANGELOG.md by name, then: python -m tests.test_public_api --write"


def public_callables(package: griffe.Object) -> list[griffe.Object]:
    """Every public function and class, and each class's public methods (with ``__init__`` and
    ``__call__`` where the class defines them)."""
    found = []
    for path in public_paths(package):
        obj = target(package[path.removeprefix("fibjax.")])
        if obj.is_class:
            methods = [m for m in obj.members.values() if not isinstance(m, griffe.Alias) and m.is_function]
            found += [m for m in methods if not m.name.startswith("_") or m.name in ("__init__", "__call__")]
        if obj.is_function or obj.is_class:
            found.append(obj)
    return found


def test_every_public_callable_has_a_docstring_that_pydoclint_checks():
    """interrogate's floor counts the internals too and pydoclint skips what has no docstring, so:
    every public function, class and method has one (a constructor may leave it to its class),
    and none is among the internals' docstrings that .pydoclint-baseline.txt lets pass unchecked."""
    package = load()
    baseline, current = {}, None
    for line in (ROOT / ".pydoclint-baseline.txt").read_text().splitlines():
        if line and not line.startswith(" ") and not line.startswith("-"):
            current = line.strip()
        elif match := re.search(r"(?:Function|Method) `([\w.]+)`", line):
            baseline.setdefault(current, set()).add(match[1])
    undocumented, unchecked = [], []
    for obj in public_callables(package):
        if obj.docstring is None and obj.name != "__init__":
            undocumented.append(obj.path)
        name = obj.path.removeprefix(f"{obj.module.path}.")
        if {name, f"{name}.__init__"} & baseline.get(str(obj.filepath.relative_to(ROOT)), set()):
            unchecked.append(obj.path)
    assert undocumented == []
    assert unchecked == [], "write its Args/Returns/Raises and take it out of .pydoclint-baseline.txt"
    assert len(public_callables(package)) > 150


def test_a_break_is_found():
    a, b = ["a", "positional or keyword", False], ["b", "keyword-only", False]
    save = {"kind": "function", "parameters": [["step", "positional or keyword", True]]}
    old = {"kind": "class", "parameters": [a], "methods": {"save": save}}
    new = {"kind": "class", "parameters": [a, b], "methods": {"save": {"kind": "function", "parameters": [["step", "positional or keyword", False]]}}}
    assert breaks(old, new, "X") == ["X: new required parameter b", "X.save: parameter step now required"]
    assert breaks(old, {**old, "methods": {}}, "X") == ["X.save: removed"]
    assert breaks(old, old, "X") == []


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(surface(), indent=1, sort_keys=True) + "\n")
        print(f"written: {RECORD.relative_to(ROOT)}")
