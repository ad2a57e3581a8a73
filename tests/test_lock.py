"""One run per workdir (issue 30): a second start is refused at once, naming the holder; the lock
goes with its holder however it ends; a refused start leaves nothing behind."""

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fibjax.run.lock import LOCK_FILE, WorkdirInUse, WorkdirLock
from tests.helpers import ROOT, assert_one_error, train_cmd, train_main
from tests.tiers import slow

HOLD = "import sys, time; from fibjax.run.lock import WorkdirLock; WorkdirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)"


def holder(workdir) -> subprocess.Popen:
    """Another process holding the lock of ``workdir`` (no JAX: it starts in a fraction of a second)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_workdir_is_refused_naming_its_holder_and_freed_when_the_holder_is_killed(tmp_path):
    workdir = tmp_path / "run"
    proc = holder(workdir)
    try:
        with pytest.raises(WorkdirInUse) as caught:
            WorkdirLock(workdir).acquire()
        message = str(caught.value)
        assert "\n" not in message and f"pid {proc.pid} on host {socket.gethostname()}" in message and str(workdir) in message, message
    finally:
        proc.send_signal(signal.SIGKILL)  # no clean-up of its own: the kernel releases its flock
        proc.wait()
    assert (workdir / LOCK_FILE).exists()  # left by the killed holder, and stale
    lock = WorkdirLock(workdir)
    lock.acquire()
    assert json.loads((workdir / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (workdir / LOCK_FILE).exists()


def test_a_refused_start_in_a_new_workdir_leaves_nothing(tmp_path):
    """The lock creates the workdir; released without a run there, it removes it again (and the
    parents it created), so a refused first start leaves no directory to be refused later."""
    lock = WorkdirLock(tmp_path / "runs" / "new")
    lock.acquire()
    assert (tmp_path / "runs" / "new" / LOCK_FILE).is_file()
    lock.release()
    assert list(tmp_path.iterdir()) == []


def test_without_flock_the_file_is_the_lock_and_a_dead_holder_on_this_host_is_stale(tmp_path, monkeypatch):
    """Filesystems without flock (Lustre without -o flock): a holder on this host whose pid is gone
    is stale; a live one refuses; one on another host refuses with how to remove it."""

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    workdir = tmp_path / "run"
    workdir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = socket.gethostname()
        for pid, host, refused, hint in [(dead.pid, here, False, False), (alive.pid, here, True, False), (1, "elsewhere", True, True)]:
            (workdir / LOCK_FILE).write_text(json.dumps({"host": host, "pid": pid, "since": "then"}))
            lock = WorkdirLock(workdir)
            if not refused:
                lock.acquire()
                assert json.loads((workdir / LOCK_FILE).read_text())["pid"] == os.getpid()
                lock.release()
                continue
            with pytest.raises(WorkdirInUse, match=f"pid {pid} on host {host}") as caught:
                lock.acquire()
            assert ("delete" in str(caught.value)) == hint, caught.value
    finally:
        alive.kill()
        alive.wait()


def test_a_start_on_a_held_workdir_is_one_error_line_and_writes_nothing(tmp_path, data_dir, capsys):
    workdir = tmp_path / "run"
    proc = holder(workdir)
    try:
        start = time.perf_counter()
        rc, out = train_main(capsys, workdir, data_dir, "steps=2")
        took = time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait()
    assert_one_error(rc, out, "is in use by another run", f"pid {proc.pid} on host {socket.gethostname()}")
    assert took < 5 and sorted(p.name for p in workdir.iterdir()) == [LOCK_FILE], (took, list(workdir.iterdir()))


@slow
def test_two_runs_on_one_workdir_the_second_is_refused_and_the_first_loses_nothing(tmp_path, data_dir, capsys):
    """Before the lock, two resumes a second apart: one said "finished at step 40" while
    metrics.jsonl ended at step 21. Now the second start is refused at once; the first trains on
    to its end; after a SIGKILL of a run, the next start takes the workdir over."""
    from fibjax.train.metrics import read_metrics

    workdir = tmp_path / "run"
    first = train_cmd(workdir, data_dir, "steps=40", "checkpoint.every_steps=10", wait=False)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(workdir)) < 2:
        time.sleep(0.1)
    rc, out = train_main(capsys, workdir, data_dir, "steps=40", "checkpoint.every_steps=10")
    assert_one_error(rc, out, "is in use by another run", f"pid {first.pid}")
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0 and "finished at step 40" in out, out
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 41))

    crashed = train_cmd(workdir, data_dir, "steps=80", "checkpoint.every_steps=10", wait=False)
    while time.time() < deadline + 120 and len(read_metrics(workdir)) < 42:
        time.sleep(0.1)
    crashed.kill()
    crashed.communicate()
    rc, out = train_main(capsys, workdir, data_dir, "steps=80", "checkpoint.every_steps=10")
    assert rc == 0 and "finished at step 80" in out, out
