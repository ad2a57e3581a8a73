"""The wheel carries every package and every config: pyproject.toml lists its packages by hand
(configs/ ships as fibjax/configs), so a new package directory must be added there; and the
documented ``configs/...`` names resolve from any working directory. `.ci/wheel_smoke.sh` builds
and runs the wheel itself."""

import tomllib

import pytest

from fibjax.config import ConfigError, find_config_file
from tests.helpers import ROOT


def _listed() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def test_every_package_directory_is_in_the_wheel():
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("fibjax", "launch") for p in (ROOT / top).rglob("*.py")}
    found |= {".".join(("fibjax", *p.parent.relative_to(ROOT).parts)) for p in (ROOT / "configs").rglob("*.py")}
    assert found == _listed()


def test_a_configs_name_resolves_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config_file("configs/tiny.py") == ROOT / "configs" / "tiny.py"
    assert find_config_file("configs/cpu/dense.py") == ROOT / "configs" / "cpu" / "dense.py"
    with pytest.raises(ConfigError, match="'configs/nope.py' does not exist"):
        find_config_file("configs/nope.py")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.py").write_text("")
    assert find_config_file("configs/tiny.py").resolve() == tmp_path / "configs" / "tiny.py"  # the user's own comes first
