"""How a run ends when it is stopped: a signal ends it with exit 3 and its checkpoint whatever
happens to its output (a reader that died with the same Ctrl-C), and promptly while it compiles;
a multi-process job reports its processes in the order they end."""

import os
import signal
import subprocess
import sys
import time

from fibjax.run.integrity import finished_steps
from tests.helpers import ROOT, TINY
from tests.tiers import slow


def start_train(workdir, data_dir, *overrides, progress: bool = False) -> subprocess.Popen:
    """``launch.train`` on the tiny model, its output on a pipe read by this test."""
    cmd = [sys.executable, "-m", "launch.train", "--workdir", str(workdir), *TINY, f"data.path={data_dir}", *overrides]
    cmd += [] if progress else ["--no-progress"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def read_until(proc: subprocess.Popen, text: bytes, timeout: float = 180) -> bytes:
    seen, deadline = b"", time.monotonic() + timeout
    while text not in seen:
        chunk = os.read(proc.stdout.fileno(), 65536)
        assert chunk and time.monotonic() < deadline, seen.decode(errors="replace")
        seen += chunk
    return seen


def test_writes_to_a_closed_pipe_are_dropped_not_raised():
    from launch._streams import _DroppedWhenClosed

    read, write = os.pipe()
    os.close(read)
    stream = _DroppedWhenClosed(os.fdopen(write, "w"))
    stream.write("a line nobody reads\n")
    stream.flush()
    stream.write("and another\n")
    stream.flush()


@slow
def test_ctrl_c_with_output_piped_to_a_reader_that_died_exits_3_with_its_checkpoint(tmp_path, data_dir):
    """``launch.train ... | tee log`` and Ctrl-C: tee dies, the run saves. Before, the progress
    bar's next write met the closed pipe, was taken for a failed workdir write, and the run exited
    1 or 2 (measured: 1, with nothing printed), though its checkpoint was saved."""
    workdir = tmp_path / "run"
    proc = start_train(workdir, data_dir, "steps=100000", "checkpoint.every_steps=100000", progress=True)
    read_until(proc, b"step/s")  # training, past compilation
    proc.stdout.close()  # the reader dies
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 3
    assert finished_steps(workdir), "no checkpoint saved"


@slow
def test_a_signal_while_compiling_stops_the_run_within_seconds_with_exit_3(tmp_path, data_dir):
    """Before, the signal took effect once compilation ended (58 s on a busy machine in the issue;
    ~10 s for this model on 2 idle cores)."""
    proc = start_train(tmp_path / "run", data_dir, "steps=50")
    read_until(proc, b"compiling the training step")
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    out = proc.stdout.read().decode()
    assert rc == 3 and time.monotonic() - sent < 4, (rc, time.monotonic() - sent, out)
    assert "stopped by a signal while compiling" in out, out


FAKE_PYTHON = """#!/usr/bin/env bash
# process 1 fails first (status 9); process 0 ends (status 2) as soon as the script has recorded
# process 1's end (its order file, under TMPDIR), well within one 0.2 s poll. Waiting for the
# record, not a fixed head start (20 ms once lost to a loaded machine), keeps the order certain.
while (($#)); do [[ $1 == --process-id ]] && id=$2; shift; done
if ((id == 1)); then sleep 0.3; exit 9; fi
until grep -qs "^1 " "$TMPDIR"/local_multiprocess.*; do sleep 0.005; done
exit 2
"""


def test_local_multiprocess_reports_the_first_process_to_end_and_exits_with_its_status(tmp_path):
    """Before, it scanned the processes by index: process 0, ending just after process 1, was
    reported first and its status returned."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "PORT": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "launch" / "local_multiprocess.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    ended = [line for line in proc.stdout.splitlines() if "exited with status" in line]
    assert proc.returncode == 9 and len(ended) == 2 and "process 1 " in ended[0], proc.stdout


# A process that stops as launch.train does: on SIGINT or SIGTERM it prints its stop line a
# moment later (the checkpoint being saved) and exits 3.
STOPPING_PYTHON = """#!/usr/bin/env python3
import signal, sys, time
def stop(signum, frame):
    time.sleep(0.5)
    print("stopped by a signal at step 3: run the same command to resume", flush=True)
    sys.exit(3)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
print("[Gloo] connected", flush=True)
print("training", flush=True)
while True:
    time.sleep(0.05)
"""


def test_local_multiprocess_under_a_terminal_ctrl_c_shows_the_stop_lines_and_exits_3(tmp_path):
    """A terminal's Ctrl-C signals the whole process group. Before, the output filter (grep) died
    with it, so the processes' stop lines met a closed pipe, and the subshells that record each
    process's end died too, leaving the script waiting for ever."""
    fake = tmp_path / "python"
    fake.write_text(STOPPING_PYTHON)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "PORT": "1", "TMPDIR": str(tmp_path)}
    cmd = ["bash", str(ROOT / "launch" / "local_multiprocess.sh")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    seen = read_until(proc, b"training\ntraining\n", timeout=60)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
    try:
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (seen + rest).decode()
    assert proc.returncode == 3 and out.count("stopped by a signal at step 3: run the same command to resume") == 2, out
    assert "[Gloo]" not in out and out.count("exited with status 3") == 2, out


def signalled_during(monkeypatch, module, name, sig):
    """``module.name`` sends this process ``sig`` as it is called (a Ctrl-C or SIGTERM arriving then)."""
    original = getattr(module, name)

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, signalled)


def test_a_signal_while_the_command_starts_stops_it_before_anything_started_with_exit_3(tmp_path, data_dir, monkeypatch, capsys):
    """Before, the handler was installed with the training loop (~1.2 s in): SIGTERM then exited
    143, and Ctrl-C printed a KeyboardInterrupt traceback or was swallowed by JAX's gc callback."""
    import fibjax.config
    from launch.train import main

    signalled_during(monkeypatch, fibjax.config, "load_config_file", signal.SIGINT)
    rc = main(["--workdir", str(tmp_path / "run"), "--no-progress", *TINY, f"data.path={data_dir}", "steps=4"])
    out = capsys.readouterr().out
    assert rc == 3 and "stopped by a signal before anything started" in out, out
    assert not (tmp_path / "run").exists()


def test_a_signal_during_the_checks_stops_the_run_before_its_first_step_with_exit_3(tmp_path, data_dir, monkeypatch, capsys):
    import fibjax.train.loop as loop
    from launch.train import main

    signalled_during(monkeypatch, loop, "preflight", signal.SIGTERM)
    rc = main(["--workdir", str(tmp_path / "run"), "--no-progress", *TINY, f"data.path={data_dir}", "steps=4"])
    out = capsys.readouterr().out
    assert rc == 3 and "stopped by a signal before the first step: nothing was trained" in out, out
    assert not finished_steps(tmp_path / "run")


@slow
def test_a_signal_during_the_end_of_run_evaluation_exits_3_and_the_same_command_evaluates(tmp_path, data_dir):
    workdir = tmp_path / "run"
    proc = start_train(workdir, data_dir, "steps=2", "eval.at_end=true", "eval.max_tokens=4096")
    seen = read_until(proc, b"finished at step 2")
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    out = (seen + proc.stdout.read()).decode()
    assert rc == 3 and "stopped by a signal during the end-of-run evaluation: training is complete" in out, out
    assert "Traceback" not in out and not (workdir / "eval" / "2.json").exists(), out
    proc = start_train(workdir, data_dir, "steps=2", "eval.at_end=true", "eval.max_tokens=4096")
    assert proc.wait(timeout=300) == 0 and (workdir / "eval" / "2.json").exists()
