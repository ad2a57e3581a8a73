"""Multi-process start-up in one place: one CPU, TPU pod slices, GPU clusters.

``initialize()`` starts JAX's distributed runtime only when the launch environment says this
process is one of several, so the same command runs on a laptop and on a pod. In order:

1. ``FIBJAX_COORDINATOR=host:port``, ``FIBJAX_NUM_PROCESSES``, ``FIBJAX_PROCESS_ID`` (what
   ``--coordinator/--num-processes/--process-id`` of ``launch.train``, ``launch.eval`` and
   ``launch.passkey`` set): explicit.
2. SLURM with more than one task (inside ``srun``): JAX reads the scheduler's variables.
3. A Cloud TPU VM (TPU chips on the PCI bus, or GKE's ``TPU_WORKER_HOSTNAMES``): JAX asks the
   TPU metadata for the workers; run the same command on every worker.

``FIBJAX_DISTRIBUTED=off`` never initialises (e.g. a one-process CPU job on a TPU host); ``=on``
always lets JAX auto-detect (Open MPI, Kubernetes, ...). On CPU the processes' collectives go
over TCP (gloo).

Failures are bounded. Start-up waits at most ``FIBJAX_INIT_TIMEOUT`` seconds (default 300) for
every process to connect, then prints what to check and exits with status 2. Afterwards a
process that dies (killed, crashed) ends the job within seconds: every other process prints one
line naming it and exits with status 2 (``PeerWatch``). A host that vanishes without closing its
connections (power, network) sends no heartbeat for ``FIBJAX_HEARTBEAT_TIMEOUT`` seconds (default
100, JAX's); it is then declared dead, and JAX's runtime aborts every other process with "another
task died". A process leaving normally waits at most that long for the others to leave too.
"""

from __future__ import annotations

import atexit
import os
import selectors
import socket
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np

from fibjax.errors import FibjaxError

T = TypeVar("T")
_MESSAGE_BYTES = 4096
_JAX_GRACE_S = 30  # JAX's own connect deadline is later than ours, so ours reports the failure


class DistributedError(FibjaxError, RuntimeError):
    """The processes could not start together, or another process failed; the message says which."""


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise DistributedError(f"{name} must be set (with FIBJAX_COORDINATOR; --num-processes and --process-id set them)")
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name} must be an integer, got {value!r}") from None


def _on_cloud_tpu_vm() -> bool:
    if os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("TPU_PROCESS_ADDRESSES"):  # GKE
        return True
    try:  # JAX's own check (TPU chips on the PCI bus); private, so a moved module means "no TPU"
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:
        return False


def launch_mode() -> str:
    """``"explicit"``, ``"auto"`` (JAX detects SLURM / TPU) or ``"single"``."""
    env = os.environ
    switch = env.get("FIBJAX_DISTRIBUTED", "auto")
    if switch not in ("auto", "on", "off"):
        raise DistributedError(f"FIBJAX_DISTRIBUTED must be auto, on or off, got {switch!r}")
    if switch == "off":
        return "single"
    if env.get("FIBJAX_COORDINATOR"):
        return "explicit"
    slurm = all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID"))
    if switch == "on" or (slurm and _env_int("SLURM_NTASKS", 1) > 1) or _on_cloud_tpu_vm():
        return "auto"
    return "single"


def initialize() -> None:
    """Start the JAX distributed runtime if this process is one of several (idempotent)."""
    mode = launch_mode()
    if mode == "single" or jax.distributed.is_initialized():
        return
    kwargs = {}
    where = "the coordinator JAX detected (SLURM or TPU metadata)"
    if mode == "explicit":
        num, pid = _env_int("FIBJAX_NUM_PROCESSES"), _env_int("FIBJAX_PROCESS_ID")
        if not 0 <= pid < num:
            raise DistributedError(f"FIBJAX_PROCESS_ID must lie in [0, FIBJAX_NUM_PROCESSES={num}), got {pid}")
        kwargs = {"coordinator_address": os.environ["FIBJAX_COORDINATOR"], "num_processes": num, "process_id": pid}
        where = f"coordinator {kwargs['coordinator_address']} as process {pid} of {num}"
    init_timeout = _env_int("FIBJAX_INIT_TIMEOUT", 300)
    heartbeat = _env_int("FIBJAX_HEARTBEAT_TIMEOUT", 100)
    failure = (
        f"distributed start-up failed: not every process connected to {where} within FIBJAX_INIT_TIMEOUT="
        f"{init_timeout} s. Start the same command on every host with the same coordinator and process count "
        f"and a distinct process id, and check that the coordinator's host:port is reachable from every host."
    )
    # gloo: CPU processes need a cross-process collective backend (jax < 0.5 had none by default);
    # it only concerns the CPU client, so it is harmless on GPU and TPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service (multihost_utils.reached_preemption_sync_point) is unused: SIGTERM
    # is handled by the training loop, agreed by an all-gather. Off, a dead coordinator is not
    # also reported by its C++ poller, five lines per surviving process.
    jax.config.update("jax_enable_preemption_service", False)
    # A connection timeout inside JAX aborts the process from C++ with "another task died", which
    # misleads; this timer fires first, says what happened, and exits.
    watchdog = threading.Timer(init_timeout, _exit_with, args=(failure,))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            **kwargs, initialization_timeout=init_timeout + _JAX_GRACE_S, heartbeat_timeout_seconds=heartbeat, shutdown_timeout_seconds=heartbeat
        )
    except Exception as e:  # bad arguments, or no cluster JAX could detect with FIBJAX_DISTRIBUTED=on
        raise DistributedError(f"{failure} ({type(e).__name__}: {str(e).strip()[:500]})") from e
    finally:
        watchdog.cancel()
    PeerWatch.start()


def _exit_with(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)  # the main thread is blocked in C++; only a hard exit ends the process


def is_main() -> bool:
    return jax.process_index() == 0


def _broadcast(message: bytes) -> str:
    """Process 0's ``message`` (at most _MESSAGE_BYTES), on every process (a collective)."""
    from jax.experimental import multihost_utils

    buffer = np.zeros(_MESSAGE_BYTES, np.uint8)
    buffer[: len(message)] = np.frombuffer(message[:_MESSAGE_BYTES], np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).rstrip(b"\0").decode(errors="replace")


def on_main(fn: Callable[[], T], what: str) -> T | None:
    """Run ``fn`` on process 0 only while the others wait; every process raises if it failed.

    The others raise ``DistributedError`` with process 0's message, so a failure there (a bad
    workdir, a missing file) ends every process instead of leaving them in a barrier.
    """
    if jax.process_count() == 1:
        return fn()
    result, error, message = None, None, b""
    if is_main():
        try:
            result = fn()
        except Exception as e:
            error, message = e, f"{type(e).__name__}: {e}".encode()
    received = _broadcast(message)
    if error is not None:
        raise error
    if received:
        raise DistributedError(f"process 0 failed while {what}: {received}")
    return result


class PeerWatch:
    """A job ends within seconds of a process's death, each survivor saying which process died.

    Every process holds a TCP connection to process 0 (a star). The kernel closes a process's
    connections however it dies (SIGKILL, a segfault, the OOM killer), so the other end sees the
    stream end at once; a process leaving through Python says "bye" first (atexit). On an end
    without "bye", process 0 tells the others which process died; every survivor prints one line
    naming it and exits with status 2. Before, the survivors waited in a collective until JAX's
    heartbeat timeout (54-81 s measured with the default 100 s) and aborted (134) after ~65
    lines of C++ traces. Lines on the wire: ``hello K <who>``, ``bye K``, ``dead K <who>``."""

    def __init__(self, me: int, count: int):
        self.me, self.count = me, count
        self.who = {me: f"pid {os.getpid()} on host {socket.gethostname()}"}
        self.left: set[int] = set()  # processes that said bye
        self.leaving = False
        self.peers: dict[socket.socket, int | None] = {}  # process 0: a connection per process

    @classmethod
    def start(cls) -> None:
        me = jax.process_index()
        if jax.process_count() == 1:
            return
        watch = cls(me, jax.process_count())
        ipv6 = socket.has_dualstack_ipv6()  # then IPv4 and IPv6 peers alike
        server = socket.create_server(("", 0), family=socket.AF_INET6 if ipv6 else socket.AF_INET, dualstack_ipv6=ipv6) if me == 0 else None
        coordinator = os.environ.get("FIBJAX_COORDINATOR", "").rpartition(":")[0].strip("[]") or socket.gethostname()
        address = _broadcast(f"{coordinator}:{server.getsockname()[1]}".encode() if server else b"")
        if server:
            target = lambda: watch._serve(server)  # noqa: E731
        else:
            host, _, port = address.rpartition(":")
            try:
                conn = socket.create_connection((host, int(port)), timeout=60)
            except OSError as e:  # a firewall: the heartbeat timeout still bounds a dead peer's wait
                print(f"warning: cannot reach process 0 at {address} ({e}): a dead process ends this job only at the heartbeat timeout", file=sys.stderr)
                return
            conn.settimeout(None)
            watch.peers[conn] = 0
            watch._send(conn, f"hello {me} {watch.who[me]}")
            target = lambda: watch._follow(conn)  # noqa: E731
        threading.Thread(target=target, name="fibjax-peer-watch", daemon=True).start()
        atexit.register(watch.leave)

    def _send(self, conn: socket.socket, line: str) -> None:
        try:
            conn.sendall(line.encode() + b"\n")
        except OSError:  # that process is gone: its own end says so
            pass

    def _serve(self, server: socket.socket) -> None:
        """Process 0: accept every process's connection; watch them all."""
        selector = selectors.DefaultSelector()
        selector.register(server, selectors.EVENT_READ)
        pending: dict[socket.socket, bytes] = {}
        while True:
            for key, _ in selector.select():
                if key.fileobj is server:
                    conn, _ = server.accept()
                    self.peers[conn], pending[conn] = None, b""
                    selector.register(conn, selectors.EVENT_READ)
                    self._send(conn, f"hello 0 {self.who[0]}")
                    continue
                conn = key.fileobj
                data = self._receive(conn)
                if data:
                    *lines, pending[conn] = (pending[conn] + data).split(b"\n")
                    for line in lines:
                        self._heard(line.decode(errors="replace"), conn)
                    continue
                selector.unregister(conn)
                process = self.peers.pop(conn)
                if process is not None and process not in self.left:
                    for other in self.peers:
                        self._send(other, f"dead {process} {self.who[process]}")
                    self._died(process)

    def _follow(self, conn: socket.socket) -> None:
        """Process 1..N-1: watch process 0, which also reports the others."""
        pending = b""
        while data := self._receive(conn):
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                self._heard(line.decode(errors="replace"), conn)
        if 0 not in self.left:
            self._died(0)

    @staticmethod
    def _receive(conn: socket.socket) -> bytes:
        try:
            return conn.recv(4096)
        except OSError:  # reset by the dying end: the same as its end
            return b""

    def _heard(self, line: str, conn: socket.socket) -> None:
        word, process, who = (line.split(" ", 2) + ["", ""])[:3]
        if not process.isdigit():  # not one of ours
            return
        process = int(process)
        if word == "hello":
            self.who[process] = who
            self.peers[conn] = process
        elif word == "bye":
            self.left.add(process)
        elif word == "dead":
            self.who[process] = who
            self._died(process)

    def _died(self, process: int) -> None:
        if self.leaving:  # this process is leaving normally itself: nothing is lost
            return
        self.leaving = True
        who = self.who.get(process, "its pid and host unknown: it died before it said hello")
        print(f"error: process {process} of {self.count} ({who}) died (killed or crashed); process {self.me} stops too", file=sys.stderr, flush=True)
        os._exit(2)  # the main thread may be blocked in C++ in a collective with the dead process

    def leave(self) -> None:
        """atexit: say bye, so that the others do not take this normal exit for a death."""
        self.leaving = True
        for conn in list(self.peers):
            self._send(conn, f"bye {self.me}")
