"""What an installed fibjax (a wheel, no clone) asks of its user: a console script beside every
``python -m launch.NAME``, remedies that name the install command that fits (``pip install
"fibjax[hf]"`` for a wheel, ``pip install -e ".[hf]"`` in a clone), one ``error:`` line when an
extra is missing, defaults that need no repository files, and an sdist that carries what its
tests read (MANIFEST.in)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tomllib

from fibjax import errors
from launch.__main__ import entry_points
from tests.helpers import ROOT
from tests.tiers import slow


def test_every_entry_point_has_a_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {f"fibjax-{name.replace('_', '-')}": f"launch.{name}:main" for name in entry_points()}


def test_remedies_name_the_install_that_fits(monkeypatch, tmp_path):
    assert errors.pip_install("hf") == 'pip install -e ".[hf]"'  # this checkout: a clone
    wheel = tmp_path / "site-packages" / "fibjax" / "errors.py"
    monkeypatch.setattr(errors, "__file__", str(wheel))
    assert errors.pip_install("hf") == 'pip install "fibjax[hf]"'


def test_no_message_tells_a_wheel_user_to_install_from_a_clone():
    """A remedy is ``pip_install(extra)``, or names both forms; a bare ``pip install -e`` in a
    string would send a wheel user to a source tree they do not have."""
    bare = []
    for path in sorted([*(ROOT / "fibjax").rglob("*.py"), *(ROOT / "launch").glob("*.py")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "pip install -e" in line and "fibjax[" not in line and "in a clone" not in line and "def pip_install" not in line:
                bare.append(f"{path.relative_to(ROOT)}:{n}")
    assert bare == []
    assert any("pip install -e" in line for line in errors.pip_install.__doc__.splitlines())


def test_the_harness_without_lm_eval_is_one_error_line(tmp_path):
    hide = "import sys; sys.modules['lm_eval'] = None; from launch import harness; sys.exit(harness.main(['--tasks', 'lambada_openai']))"
    result = subprocess.run([sys.executable, "-c", hide], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2
    expected = f"error: launch.harness needs EleutherAI's lm-evaluation-harness (the harness extra): {errors.pip_install('harness')}"
    assert result.stderr.splitlines() == [expected]
    assert "Traceback" not in result.stdout + result.stderr


def test_draw_attention_defaults_need_no_repository_files(tmp_path, monkeypatch, capsys):
    from launch import draw_attention

    monkeypatch.chdir(tmp_path)
    assert draw_attention.main([]) == 0
    assert "learned panel is left out" in capsys.readouterr().out
    assert (tmp_path / "docs" / "images" / "attended_distances.png").is_file()


# what the tests read outside the packages: pages, notes, results, the citation and the site config
SDIST_NEEDS = ["docs/index.md", "docs/reference/api.md", "CHANGELOG.md", "CITATION.cff", "mkdocs.yml", "BUILD_NOTES.md", "LICENSE", "README.md"]
SDIST_NEEDS += ["tests/conftest.py", "tests/test_doc_pages.py", "results/study/alpha.csv", "results/study/report.md", ".ci/run", ".pydoclint-baseline.txt"]


@slow
def test_the_sdist_carries_what_its_tests_read(tmp_path):
    """Builds the sdist (about 20 s); .ci/run builds it again and runs tests from it unpacked."""
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    [sdist] = tmp_path.glob("fibjax-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert [need for need in SDIST_NEEDS if need not in members] == []
    assert not [m for m in members if "__pycache__" in m or m.endswith(".pyc")]
