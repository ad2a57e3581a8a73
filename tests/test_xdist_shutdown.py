"""The end of a ``pytest -n 2`` run prints no KeyboardInterrupt traceback.

execnet ends each xdist worker by sending it SIGINT 5 s after the controller closes it (its
_terminate_execution). A worker still finishing (pytest's last garbage collection, on busy
cores) took that KeyboardInterrupt inside JAX's gc callback, and printed it as a
PytestUnraisableExceptionWarning after the results. tests/conftest.py makes a worker ignore
SIGINT once its tests are done; here a small suite's workers send themselves SIGINT in their
last hook, as execnet does, and record whether it interrupted them."""

import os
import subprocess
import sys

from tests.helpers import ROOT

LATE_SIGINT = """
import os, signal, time
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    try:
        os.kill(os.getpid(), signal.SIGINT)  # what execnet sends a worker that is still busy
        time.sleep(0.2)
        Path(__file__).with_name(f"done-{worker}").touch()
    except KeyboardInterrupt:
        Path(__file__).with_name(f"interrupted-{worker}").touch()
"""


def test_a_sigint_after_the_tests_does_not_interrupt_an_xdist_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(LATE_SIGINT)
    (tmp_path / "test_two.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "--rootdir", str(tmp_path), str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # this test may itself run in an xdist worker
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "2 passed" in out, out
    assert sorted(p.name for p in tmp_path.glob("done-*")) == ["done-gw0", "done-gw1"], out
    assert not list(tmp_path.glob("interrupted-*")) and "KeyboardInterrupt" not in out, out
