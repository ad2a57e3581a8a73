"""One run per workdir: ``<workdir>/fibjax.lock``, held by the training process (process 0 of a job).

Two runs in one workdir overwrite each other's checkpoints and metrics (measured before the lock:
one resume said "finished at step 40" while metrics.jsonl ended at step 21; two fresh starts hung
five minutes on an Orbax barrier). The lock is an flock(2) on the file: the kernel releases it
when its holder exits in any way, SIGKILL included, so a crashed run never blocks the next one
(on NFS, when the crashed host's lease expires). The file names its holder (host, pid, start
time) for the message a second start prints. Where the filesystem has no flock (Lustre mounted
without it), the file alone is the lock: it is stale when its holder's host is this one and no
process has its pid; a holder on another host cannot be checked, so the message says how to
remove the file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from fibjax.errors import FibjaxError

LOCK_FILE = "fibjax.lock"


class WorkdirInUse(FibjaxError, RuntimeError):
    """Another run holds the workdir; the message names its host and pid."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class WorkdirLock:
    """``acquire()`` or raise WorkdirInUse; ``release()`` removes the file, and the workdir (and
    parents) it created if they are still empty, so a refused start leaves nothing behind.

    Args:
        workdir: The run directory (created if missing).
    """

    def __init__(self, workdir: str | Path):
        self.workdir = Path(workdir).absolute()
        self.path = self.workdir / LOCK_FILE
        self._fd: int | None = None
        self._created: list[Path] = []

    def acquire(self) -> None:  # noqa: DOC503
        """Take the workdir's lock (an ``flock`` on its lock file, or the file alone where the filesystem
        has no locks), creating the workdir if needed.

        Raises:
            WorkdirInUse: Another run holds it (named by pid, host and start time).
        """
        self._created = [p for p in [self.workdir, *self.workdir.parents] if not p.exists()]
        while self._fd is None:
            self.workdir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._refuse(self._holder(), stale_hint=False)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                self._acquire_without_flock()
                return
            if self._same_file(fd):  # else a releasing holder unlinked it after we opened it: again
                self._fd = fd
                self._write_holder(fd)
            else:
                os.close(fd)

    def _acquire_without_flock(self) -> None:
        for _ in range(2):  # the second try follows the removal of a stale file
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", 0))):
                    self.path.unlink(missing_ok=True)  # its holder crashed: stale
                    continue
                self._refuse(holder, stale_hint=holder.get("host") != socket.gethostname())
            self._fd = fd
            self._write_holder(fd)
            return
        self._refuse(self._holder(), stale_hint=False)

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _write_holder(self, fd: int) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):  # being written, or removed just now
            return {}

    def _refuse(self, holder: dict, *, stale_hint: bool) -> None:
        self._remove_created()
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since {holder.get('since', '?')}"
        hint = f"; if that run is no longer alive, delete {self.path}" if stale_hint else ""
        raise WorkdirInUse(f"workdir {self.workdir} is in use by another run ({who}): wait for it to end or stop it, or use another --workdir{hint}")

    def release(self) -> None:
        """Remove the lock file and release it, and the directories ``acquire`` created if still empty."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still held: a waiting start then finds no file, or its own
        os.close(self._fd)
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for directory in self._created:  # deepest first
            try:
                directory.rmdir()
            except OSError:  # not empty: the run wrote there
                break
        self._created = []
