"""``launch/gpu_check.sh``: its steps, in order, each bounded by what the deadline leaves (the
whole script runs in ``--rehearse`` on CPU in ~10 minutes: BUILD_NOTES, "GPU check")."""

import os
import re
import subprocess
import sys

from tests.helpers import ROOT

STEPS = ["0", "1", "2a", "2b", "2c", "2d", "2e", "3", "4a", "4b", "4c", "4d"]


def test_a_spent_deadline_skips_every_step_in_order(tmp_path):
    env = {**os.environ, "DEADLINE": "0", "OUT": str(tmp_path), "PY": sys.executable}
    run = subprocess.run(["bash", "launch/gpu_check.sh", "--rehearse"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    log = (tmp_path / "gpu_check.log").read_text()
    assert re.findall(r"^== (\w+)\. .*: skipped", log, flags=re.M) == STEPS
    assert not (tmp_path / "table.md").exists()


def test_steps_runs_only_the_steps_named(tmp_path):
    """STEPS="2c 2d" (the variants and the block-size sweep alone): every other step says "not
    selected", in order, and the two named ones meet the deadline as usual (spent here: skipped)."""
    env = {**os.environ, "DEADLINE": "0", "OUT": str(tmp_path), "PY": sys.executable, "STEPS": "2c 2d"}
    run = subprocess.run(["bash", "launch/gpu_check.sh", "--rehearse"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    log = (tmp_path / "gpu_check.log").read_text()
    assert re.findall(r"^== (\w+)\. .*: not selected", log, flags=re.M) == [s for s in STEPS if s not in ("2c", "2d")]
    assert re.findall(r"^== (\w+)\. .*: skipped", log, flags=re.M) == ["2c", "2d"]
