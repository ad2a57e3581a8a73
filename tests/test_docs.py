"""The generated configuration reference is current and complete, and the attention reference
names every public attention function. The pages' code blocks are tests/test_doc_pages.py's;
links, commands in prose and messages, and timings are tests/test_docs_drift.py's."""

from __future__ import annotations

import dataclasses

import pytest

from fibjax import config as config_module
from fibjax import config_reference
from tests.helpers import ROOT

DOCS = ROOT / "docs"


def test_config_reference_is_current():
    committed = (DOCS / "reference" / "config.md").read_text()
    assert committed == config_reference.render(), "docs/reference/config.md is stale: run python -m fibjax.config_reference"


def test_config_reference_covers_every_field():
    text = config_reference.render()

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            child = config_reference._section_type(cls, f.name)
            yield from keys(child, f"{prefix}{f.name}.") if child else (f"{prefix}{f.name}",)

    missing = [k for k in keys(config_module.TrainConfig) if f"| `{k}` |" not in text]
    assert not missing


@dataclasses.dataclass(frozen=True)
class _Inner:
    """An inner section."""

    # how wide | with a pipe and <angle brackets>
    width: int = 3
    flag: bool = False  # set it


@dataclasses.dataclass(frozen=True)
class _Outer:
    """The root."""

    # the run's name
    name: str = "x"
    inner: _Inner = dataclasses.field(default_factory=_Inner)


@dataclasses.dataclass(frozen=True)
class _Undocumented:
    """A field below has no comment."""

    # documented
    a: int = 1
    b: int = 2


def test_reference_rows_carry_key_type_default_and_comment():
    text = config_reference.render(_Outer, header="")
    assert "## Top level (_Outer)\n\nThe root.\n" in text
    assert "| `name` | `str` | `'x'` | the run's name |" in text
    assert "## `inner` (_Inner)\n\nAn inner section.\n" in text
    assert "| `inner.width` | `int` | `3` | how wide \\| with a pipe and &lt;angle brackets> |" in text
    assert "| `inner.flag` | `bool` | `False` | set it |" in text


def test_a_field_without_a_comment_is_an_error_naming_it():
    with pytest.raises(config_reference.UndocumentedField, match=r"_Undocumented\.b \(b\)"):
        config_reference.render(_Undocumented, header="")


def test_check_mode_fails_on_a_stale_reference(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(config_reference.render().replace("| `seed` |", "| `sed` |"))
    monkeypatch.setattr(config_reference, "OUT", stale)
    assert config_reference.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert config_reference.main([]) == 0
    assert config_reference.main(["--check"]) == 0


ATTENTION_REFERENCE = DOCS / "reference" / "attention.md"


def test_attention_reference_names_every_public_function():
    import fibjax.attention as fa

    text = ATTENTION_REFERENCE.read_text()
    assert [name for name in fa.__all__ if f"`{name}" not in text] == []
