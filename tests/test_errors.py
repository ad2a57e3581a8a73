"""One base error class (fibjax.errors.FibjaxError) under every fibjax error, and the old import
paths of moved modules still working, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

from fibjax.errors import FibjaxError

ROOT = Path(__file__).resolve().parent.parent / "fibjax"
BUILTIN_ERRORS = {"Exception", "ValueError", "RuntimeError", "NotImplementedError", "OSError", "KeyError", "TypeError", "LookupError"}
# raised and caught inside the benchmark to skip a row a platform cannot run: never reaches a user
INTERNAL = {"fibjax.bench.attention.Unavailable"}


def error_classes() -> list[str]:
    """Every class in fibjax that derives directly from a built-in exception, as module.Class."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and {ast.unparse(b) for b in node.bases} & BUILTIN_ERRORS:
                found.append(f"{module}.{node.name}")
    return found


def test_every_fibjax_error_is_a_fibjax_error_and_keeps_its_builtin_base():
    names = [n for n in error_classes() if n not in INTERNAL]
    assert len(names) >= 15 and "fibjax.config.ConfigError" in names and "fibjax.run.workdir.CheckpointError" in names
    for name in names:
        module, _, cls_name = name.rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        assert issubclass(cls, FibjaxError), f"{name} does not subclass fibjax.errors.FibjaxError"
    from fibjax.config import ConfigError
    from fibjax.run.workdir import CheckpointError

    assert issubclass(ConfigError, ValueError) and issubclass(CheckpointError, RuntimeError)  # `except ValueError` keeps working


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("fibjax.train.checkpoint", "Checkpointer", "fibjax.run.checkpoints"),
        ("fibjax.train.checkpoint", "CheckpointError", "fibjax.run.workdir"),
        ("fibjax.train.checkpoint", "SUMS_FILE", "fibjax.run.integrity"),
        ("fibjax.train.checkpoint", "disk_full", "fibjax.run.failures"),
        ("fibjax.train.checkpoint", "LOCK_FILE", "fibjax.run.lock"),
        ("fibjax.train.lock", "WorkdirLock", "fibjax.run.lock"),
        ("fibjax.train.sharding", "make_mesh", "fibjax.sharding"),
        ("fibjax.eval.runner", "load_run", "fibjax.run.load"),
        ("fibjax.eval.runner", "run_tokenizer", "fibjax.run.load"),
    ],
)
def test_a_moved_name_still_imports_from_its_old_module_with_a_deprecation_warning(old, name, new):
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} has moved: use {new}\.{name}"):
        obj = getattr(importlib.import_module(old), name)
    assert obj is getattr(importlib.import_module(new), name)


def test_an_unknown_name_of_a_moved_module_is_an_attribute_error_without_a_warning():
    from fibjax.eval import runner

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
            _ = importlib.import_module("fibjax.train.checkpoint").nothing_here
        with pytest.raises(AttributeError):
            _ = runner.Checkpointer  # imported by fibjax.run.load, but never a name of eval.runner


@pytest.mark.parametrize(("old", "new"), [("alpha_to_theta", "alpha_to_logit"), ("learned_rung_bases", "rung_slots"), ("learned_rung_spec", "rung_taps")])
def test_the_old_attention_names_warn_naming_the_new_one(old, new):
    import fibjax.attention as fa

    assert old not in fa.__all__
    with pytest.warns(DeprecationWarning, match=rf"fibjax\.attention\.{old} is deprecated: use fibjax\.attention\.{new}$"):
        assert getattr(fa, old) is getattr(fa, new)
