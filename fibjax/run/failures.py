"""A failed save in one line: the OS error behind Orbax's and TensorStore's exceptions, and
Orbax's own many reports of one failure silenced (the Checkpointer reports each failure once,
as a CheckpointError)."""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
import threading
import traceback


def os_errno(e: BaseException) -> int | None:
    """The OS error number behind an exception from Orbax, TensorStore or the OS (TensorStore
    gives it as os_error_code='28'), or None."""
    for cause in (e, e.__cause__, e.__context__):
        if isinstance(cause, OSError) and cause.errno:
            return cause.errno
        code = re.search(r"os_error_code='?(\d+)", str(cause)) if cause is not None else None
        if code:
            return int(code.group(1))
    return None


def error_reason(e: BaseException) -> str:
    """One short line for an exception from Orbax, TensorStore or the OS: the OS error where
    there is one, else the first line, cut short. TensorStore's own messages run to dozens of
    lines of JSON specs."""
    number = os_errno(e)
    if number:
        return os.strerror(number)
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}{'...' if len(first) > 160 else ''}"


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` comes from a full disk or an exhausted quota (the only errors that freeing
    space fixes)."""
    return os_errno(e) in (errno.ENOSPC, errno.EDQUOT)


def _in_orbax(path: str, tb=None) -> bool:
    return any(f"{os.sep}orbax{os.sep}" in f for f in [path] + [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)])


def _drop_orbax_errors(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or not _in_orbax(record.pathname, record.exc_info[2] if record.exc_info else None)


def quiet_orbax_failures() -> None:
    """Orbax reports one failed background save many times: absl log records, asyncio's "Task
    exception was never retrieved", uncaught exceptions in its threads and unraisable ones, each
    with a traceback (~2,000 lines for one full disk). The Checkpointer reports each failure once, as a
    CheckpointError, so those are dropped (once per process; other threads' errors still print)."""
    global _quiet
    if _quiet:
        return
    _quiet = True
    for logger in ("absl", "asyncio"):
        logging.getLogger(logger).addFilter(_drop_orbax_errors)
    previous_thread_hook, previous_unraisable_hook = threading.excepthook, sys.unraisablehook

    def thread_hook(args):
        if not _in_orbax("", args.exc_traceback):
            previous_thread_hook(args)

    def unraisable_hook(args):
        # TensorStore writes that finish after Orbax gave up on a failed save call back into
        # its closed event loop (one traceback per write); TensorStore reports it as unraisable.
        # A failed restore (another model's shapes) leaves one read coroutine per array, each
        # printed with its TensorStore spec at exit (~250 lines after the one error).
        late = args.exc_type is RuntimeError and str(args.exc_value) == "Event loop is closed"
        if late and any(frame.f_code.co_name == "call_soon_threadsafe" for frame, _ in traceback.walk_tb(args.exc_traceback)):
            return
        if not _in_orbax("", args.exc_traceback):
            previous_unraisable_hook(args)

    threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook


_quiet = False
