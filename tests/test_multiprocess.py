"""Multi-process training on one machine: 2 processes x 2 simulated CPU devices, one 4-device mesh.

Every 2-process job runs ``launch/local_multiprocess.sh``, the recipe a user copies: the same
``launch.train`` command per process, a coordinator on a free 127.0.0.1 port. Each job is its own
process group with a deadline, killed whole if a test fails.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from fibjax import distributed
from fibjax.train.metrics import read_metrics
from tests.helpers import ROOT, TINY
from tests.tiers import slow

SCRIPT = ROOT / "launch" / "local_multiprocess.sh"
HEARTBEAT_S = 10
# A constant lr after warm-up (final_lr_ratio=1): a run of steps=1000 stopped at step k follows
# the same schedule as a 1-process run of steps=k, so their losses compare step by step.
RUN = [*TINY, "steps=1000", "optim.final_lr_ratio=1.0", "checkpoint.every_steps=4", "mesh.devices=0"]
# A survivor of a killed process ends within this many seconds (measured: 0.5-0.8 s on 2 busy
# cores); before fibjax.distributed.PeerWatch, at JAX's heartbeat timeout (54-81 s by default).
PEER_DEATH_S = 5
# Tolerance: float32; the 2-process step sums the loss and gradients across processes (gloo) in
# another order than one process does. Measured: at most 1 ulp-scale differences (~8e-8 relative).
RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    # unbuffered, so the test can read progress lines while the job runs
    return {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu", "FIBJAX_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S), **extra}


class Job:
    """A subprocess in its own process group, output to a file; the group is killed on exit."""

    def __init__(self, cmd, log: Path, env: dict):
        self.log = log
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout} s:\n{self.output()[-3000:]}")

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"never saw {what} (exit status {self.proc.poll()}):\n{self.output()[-3000:]}")
            time.sleep(0.1)

    def pid(self, process: int) -> int:
        self.wait_for(lambda: f"process {process} of 2 is pid" in self.output(), 30, f"process {process} start")
        line = next(x for x in self.output().splitlines() if f"process {process} of 2 is pid" in x)
        return int(line.split(" is pid ")[1].split()[0])


def two_processes(workdir: Path, data_dir: Path, log: Path, **env) -> Job:
    cmd = ["bash", str(SCRIPT), "--workdir", str(workdir), "--no-progress", *RUN, f"data.path={data_dir}"]
    return Job(cmd, log, child_env(PYTHON=sys.executable, PORT=str(free_port()), **env))


def assert_survivor_said_once(out: str, *, dead: int, pid: int, survivor: int) -> None:
    """The killed process exited by SIGKILL; the survivor with status 2 and one line naming it."""
    assert f"process {dead} (pid {pid}) exited with status 137 (signal 9)" in out, out[-3000:]
    assert f"process {survivor} (pid " in out and out.count("exited with status 2") == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    said = f"error: process {dead} of 2 (pid {pid} on host {socket.gethostname()}) died (killed or crashed); process {survivor} stops too"
    assert errors == [said], out[-3000:]
    # no Python traceback, no C++ log line of JAX's runtime ("E1203 07:27:08.203696 ..."), except
    # its coordination agent's report of the dead coordinator: it sees the same closed socket as
    # fibjax's watcher and, on a loaded machine, may print first (the exit is still fibjax's)
    rest = [line for line in out.splitlines() if not _agent_race_line(line)] if dead == 0 else out.splitlines()
    assert "Traceback" not in out and not any(re.match(r"[EWF]\d{4} ", line) for line in rest), out[-3000:]


def _agent_race_line(line: str) -> bool:
    return bool(
        re.match(r"[EF]\d{4} .*(coordination_service_agent\.cc|client\.h):\d+\]", line)
        or line.startswith(("Additional GRPC error information from remote target coordination_service", ":UNKNOWN:Error received from peer"))
    )


def steps_in(workdir: Path) -> int:
    rows = read_metrics(workdir)
    return rows[-1]["step"] if rows else 0


def fed_rows(batch_dir: Path, process: int) -> dict[int, list[str]]:
    """step -> row hashes this process fed; a step fed twice (before a crash, after the resume)
    must have been fed the same rows."""
    seen = defaultdict(list)
    for line in (batch_dir / f"batches.{process}.jsonl").read_text().splitlines():
        row = json.loads(line)
        seen[row["step"]].append(row["rows"])
    assert all(all(r == rows[0] for r in rows) for rows in seen.values()), "a resumed step fed other rows"
    return {step: rows[0] for step, rows in seen.items()}


@slow
def test_two_processes_survive_a_kill_resume_and_match_one_process(tmp_path, data_dir):
    work, batches = tmp_path / "run", tmp_path / "batches"
    batches.mkdir()

    # 1. Train on the 2-process mesh; once the step-4 checkpoint is committed, SIGKILL process 1
    #    mid-run. Process 0 must end by itself within seconds, in one line naming process 1.
    with two_processes(work, data_dir, tmp_path / "killed.log", FIBJAX_LOG_BATCHES=str(batches)) as job:
        victim = job.pid(1)
        job.wait_for(lambda: (work / "checkpoints" / "4").is_dir(), 150, "the step-4 checkpoint")
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        job.wait(HEARTBEAT_S + 30)
        took = time.monotonic() - killed
        out = job.output()
    assert_survivor_said_once(out, dead=1, pid=victim, survivor=0)
    assert took < PEER_DEATH_S, took

    # 2. The same command resumes from the last checkpoint; SIGTERM to process 1 alone stops
    #    both processes at the same step with a checkpoint (the flag is all-gathered).
    with two_processes(work, data_dir, tmp_path / "resumed.log", FIBJAX_LOG_BATCHES=str(batches)) as job:
        victim = job.pid(1)
        job.wait_for(lambda: "resuming" in job.output(), 150, "the resume")
        resumed_from = int(job.output().split("resuming")[1].split("from step ")[1].split()[0])
        job.wait_for(lambda: steps_in(work) >= resumed_from + 3, 150, "three steps after the resume")
        os.kill(victim, signal.SIGTERM)
        rc = job.wait(60)
        out = job.output()
    assert rc == 3, out[-3000:]  # stopped before the last step: not done, so a scheduler requeues it
    stops = [line for line in out.splitlines() if line.startswith("stopped by a signal at step")]
    assert len(stops) == 2 and stops[0] == stops[1], out[-3000:]
    final = int(stops[0].split("at step ")[1].split(":")[0])
    assert (work / "checkpoints" / str(final)).is_dir() and resumed_from >= 4 and final >= resumed_from + 3

    # 3. One process with 4 devices (the same data x 4 mesh) over the same global batches.
    ref, ref_batches = tmp_path / "ref", tmp_path / "ref_batches"
    ref_batches.mkdir()
    cmd = [sys.executable, "-m", "launch.train", "--workdir", str(ref), "--no-progress", *RUN, f"steps={final}", f"data.path={data_dir}"]
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", FIBJAX_LOG_BATCHES=str(ref_batches))
    with Job(cmd, tmp_path / "ref.log", env) as job:
        assert job.wait(150) == 0, job.output()[-3000:]

    # Each process fed its own half of every global batch: different rows, together the 1-process batch.
    p0, p1, whole = fed_rows(batches, 0), fed_rows(batches, 1), fed_rows(ref_batches, 0)
    for step in range(1, final + 1):
        assert len(p0[step]) == len(p1[step]) == 4
        assert not set(p0[step]) & set(p1[step]), f"step {step}: both processes fed the same rows"
        assert p0[step] + p1[step] == whole[step], f"step {step}: the processes' rows are not the 1-process batch"

    two, one = read_metrics(work), read_metrics(ref)
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, final + 1))
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=RTOL)
    assert one[-1]["loss"] < one[0]["loss"]


@slow
def test_a_dead_coordinator_ends_the_job_within_seconds(tmp_path, data_dir):
    """SIGKILL of process 0, which also runs JAX's coordination service, with JAX's default
    heartbeat timeout (100 s): process 1 ends within seconds, in one line naming process 0."""
    work = tmp_path / "run"
    with two_processes(work, data_dir, tmp_path / "killed.log", FIBJAX_HEARTBEAT_TIMEOUT="100") as job:
        victim = job.pid(0)
        job.wait_for(lambda: steps_in(work) >= 2, 150, "two steps")
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        job.wait(150)
        took = time.monotonic() - killed
        out = job.output()
    assert_survivor_said_once(out, dead=0, pid=victim, survivor=1)
    assert took < PEER_DEATH_S, took


def test_a_failure_on_process_0_ends_every_process(tmp_path, data_dir):
    """Process 0 refuses the workdir (not empty); process 1 must not wait for it in a barrier."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with two_processes(tmp_path / "run", data_dir, tmp_path / "refused.log") as job:
        rc = job.wait(90)
        out = job.output()
    assert rc == 2 and out.count("exited with status 2") == 2, out[-3000:]
    assert "not empty" in out and "process 0 failed while claiming the workdir" in out, out[-3000:]


def test_peers_that_never_connect_are_a_clear_error(tmp_path, data_dir):
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        "--workdir",
        str(tmp_path / "run"),
        "--coordinator",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        "2",
        "--process-id",
        "0",
        *RUN,
        f"data.path={data_dir}",
    ]
    with Job(cmd, tmp_path / "alone.log", child_env(FIBJAX_INIT_TIMEOUT="2")) as job:
        rc = job.wait(60)
        out = job.output()
    assert rc == 2, out
    assert "distributed start-up failed" in out and "process 0 of 2" in out and "FIBJAX_INIT_TIMEOUT=2 s" in out, out


@slow
def test_two_processes_evaluate_as_one_device(tmp_path, data_dir):
    """A 2-process training job's end-of-run evaluation, launch.eval (perplexity, dropped mass,
    error law) and launch.passkey as 2-process jobs: the windows and prompts split over the job's
    4 devices, process 0 alone prints and writes, and the numbers are one device's (computed here
    with no mesh)."""
    from fibjax.eval import passkey, runner
    from fibjax.eval.error_law import error_law
    from fibjax.eval.perplexity import dropped_mass_by_layer, evaluate_lengths
    from fibjax.run import load as run_load

    work = tmp_path / "run"
    lengths, tokens = [32, 64], 1024

    def job(module, *args):
        cmd = ["bash", str(SCRIPT), "--workdir", str(work), *args]
        with Job(cmd, tmp_path / f"{module}.log", child_env(PYTHON=sys.executable, PORT=str(free_port()), MODULE=module)) as j:
            rc, out = j.wait(150), j.output()
        assert rc == 0, out[-3000:]
        return out

    run_args = [*TINY, "steps=3", "eval.at_end=true", f"eval.max_tokens={tokens}", "eval.length_multipliers=(1,2)", f"data.path={data_dir}", "mesh.devices=0"]
    trained = job("launch.train", "--no-progress", *run_args)
    evaluated = job("launch.eval", "--lengths", "32,64", "--max-tokens", str(tokens), "--dropped-mass", "--tag", "mp")
    run = run_load.load_run(work)
    stream = runner.dataset_streams(run, None)["python_docs"]
    one = evaluate_lengths(run.cfg.model, run.params, stream, lengths, max_tokens=tokens, rows_tokens=run.cfg.eval.batch_size * run.cfg.seq_len)
    for out, name in ((trained, "3.json"), (evaluated, "3-mp.json")):
        assert out.count("written: ") == 1 and out.count("| python_docs | 64 |") == 1, out[-3000:]  # process 0 alone reports
        report = json.loads((work / "eval" / name).read_text())
        assert report["devices"] == 4  # split over both processes' devices, not evaluated twice
        rows = report["datasets"]["python_docs"]
        assert [r["tokens"] for r in rows] == [r.tokens for r in one]
        np.testing.assert_allclose([r["nll"] for r in rows], [r.nll for r in one], rtol=1e-6)
        np.testing.assert_allclose([r["bin_nll"] for r in rows], [r.bin_nll for r in one], rtol=1e-6)
    for n in lengths:
        mass = dropped_mass_by_layer(run.cfg.model, run.params, stream, n, max_tokens=tokens, rows_tokens=96)
        np.testing.assert_allclose(report["dropped_mass"]["python_docs"][str(n)], mass, rtol=1e-5, atol=1e-7)
        law = error_law(run.cfg.model, run.params, stream, n, max_tokens=tokens, rows_tokens=96)
        got = report["error_law"]["python_docs"][str(n)]
        assert [x["queries"] for x in got] == [x["queries"] for x in law]
        np.testing.assert_allclose([x["slope"] for x in got], [x["slope"] for x in law], rtol=1e-5)

    grid = dict(lengths=[100], depths=[0.0, 1.0], trials=3, seed=1)
    job("launch.passkey", "--lengths", "100", "--depths", "0,1", "--trials", "3", "--seed", "1", "--out", str(tmp_path / "pk"))
    saved = json.loads((tmp_path / "pk" / "passkey.json").read_text())
    assert saved["devices"] == 4
    alone = passkey.passkey_grid(run.cfg.model, run.params, run_load.run_tokenizer(run), **grid)
    assert [c["answers"] for c in saved["cells"]] == [c["answers"] for c in alone["cells"]]


@pytest.mark.parametrize(
    "env, mode",
    [
        ({}, "single"),
        ({"FIBJAX_COORDINATOR": "10.0.0.1:1234", "FIBJAX_NUM_PROCESSES": "2", "FIBJAX_PROCESS_ID": "1"}, "explicit"),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}, "auto"),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, "single"),
        ({"FIBJAX_DISTRIBUTED": "off", "FIBJAX_COORDINATOR": "10.0.0.1:1234"}, "single"),
        ({"FIBJAX_DISTRIBUTED": "on"}, "auto"),
    ],
)
def test_launch_mode_from_the_environment(monkeypatch, env, mode):
    for name in [k for k in os.environ if k.startswith(("SLURM_", "FIBJAX_", "TPU_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "_on_cloud_tpu_vm", lambda: False)  # the same answer on a TPU host
    assert distributed.launch_mode() == mode
    monkeypatch.setenv("FIBJAX_DISTRIBUTED", "maybe")
    with pytest.raises(distributed.DistributedError, match="FIBJAX_DISTRIBUTED"):
        distributed.launch_mode()
