"""Standard output and error that outlive their reader.

``python -m launch.train ... | tee log`` stopped with Ctrl-C: the signal reaches ``tee`` too, which
dies at once, while the run saves its checkpoint and should exit 3. Its next line then meets a
closed pipe (EPIPE), and at exit Python's flush of the buffered rest fails again (status 120).
A reader that went away is not the run's failure: once a stream's pipe is closed, what is
written to it is dropped (as Python's documentation advises, by pointing the descriptor at
/dev/null), and the run ends as it would have.
"""

from __future__ import annotations

import errno
import os
import sys


class _DroppedWhenClosed:
    """A text stream whose writes and flushes to a closed pipe are dropped, not raised."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._drop_if_closed(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._drop_if_closed(e)

    def _drop_if_closed(self, e: OSError) -> None:
        if e.errno != errno.EPIPE:
            raise e
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # what is still buffered goes there too
        os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def survive_closed_pipes() -> None:
    """From now on, a closed pipe under stdout or stderr silences it instead of failing."""
    sys.stdout, sys.stderr = _DroppedWhenClosed(sys.stdout), _DroppedWhenClosed(sys.stderr)
