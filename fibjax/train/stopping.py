"""How a run stops when asked: SIGTERM or SIGINT sets a flag that the loop reads at each step
boundary (it saves, then exits 3), and the first step, which compiles, runs where the flag is
read while it compiles. JAX is imported only where it is used: ``launch.train`` installs the
handler before its heavy imports, so that a signal during them is a flag too, not a
KeyboardInterrupt traceback or one swallowed by JAX's garbage-collection callback."""

from __future__ import annotations

import signal
import threading


class Preemption:
    """SIGTERM / SIGINT set a flag; the loop saves at the next step boundary and exits."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def install(self) -> Preemption:
        """Handle SIGTERM and SIGINT from now on (until ``uninstall``)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def __enter__(self):
        return self.install()

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        self.uninstall()

    def agreed(self) -> bool:
        """True on every process if any process was asked to stop (all must save together)."""
        import jax
        import numpy as np

        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested))))


def unless_stopped(work, preemption: Preemption, mesh):
    """``work()`` (the first step, which compiles) in a thread, or None as soon as a signal asks
    the run to stop: compiling takes up to minutes on a busy machine, and Python runs a signal's
    handler only once the call in the main thread returns. The thread is left to the exit."""
    import jax

    box = {}

    def run():
        try:
            with jax.set_mesh(mesh):  # the mesh context is per thread
                box["value"] = work()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, name="fibjax-first-step", daemon=True)
    thread.start()
    while thread.is_alive():
        if preemption.requested:
            return None
        thread.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["value"]
