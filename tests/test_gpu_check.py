"""``launch/gpu_check.sh``: its steps, in order, each bounded by what the deadline leaves (the
whole script runs in ``--rehearse`` on CPU in ~10 minutes: BUILD_NOTES, "GPU check")."""

import os
import re
import subprocess
import sys

from tests.helpers import ROOT

STEPS = ["0", "1", "2a", "2b", "3", "4a", "4b", "4c", "4d"]


def test_a_spent_deadline_skips_every_step_in_order(tmp_path):
    env = {**os.environ, "DEADLINE": "0", "OUT": str(tmp_path), "PY": sys.executable}
    run = subprocess.run(["bash", "launch/gpu_check.sh", "--rehearse"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    log = (tmp_path / "gpu_check.log").read_text()
    assert re.findall(r"^== (\w+)\. .*: skipped", log, flags=re.M) == STEPS
    assert not (tmp_path / "table.md").exists()
