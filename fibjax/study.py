"""A study: named runs that differ only in attention (or seed), trained, evaluated and reported.

A study file (``configs/study/*.py``) defines ``get_study() -> Study``. Every step is an
ordinary fibjax command run as a child process (``launch.train``, ``launch.eval``) or the
report machinery (``fibjax.eval.report``), so a study is resumable exactly as they are: a
finished run is skipped, an unfinished one resumes from its last checkpoint.

A run is *done* when its evaluation file ``RUN/eval/<steps>.json`` exists; *running* while
``<name>.lock`` beside its directory names a live process; otherwise it is *to do* (from the
step of its latest checkpoint). The children's output goes to ``<name>.log`` beside it too.

A study outlives the machine it ran on: ``RESULTS/study.json`` (small, committed) keeps every
finished run's evaluation files and curves. On a machine without a run's directory,
:func:`restore_recorded` writes them back into it, so the run counts as done and stays in the
report instead of being trained again (its checkpoints are not kept, so nothing more can be
evaluated from it there).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fibjax.config import ConfigError, TrainConfig, apply_overrides, load_config_file


@dataclass(frozen=True)
class StudyRun:
    """One model of the study: a config file plus overrides (the study's common ones first)."""

    name: str
    config: str
    overrides: tuple[str, ...] = ()
    stage: int = 1
    # extra evaluations, each a tuple of launch.eval arguments (e.g. ("--inference-mode", "sparse"))
    extra_evals: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Study:
    name: str
    runs: tuple[StudyRun, ...]
    workdir: str = "runs/study"
    results: str = "results/study"
    overrides: tuple[str, ...] = ()  # applied to every run (the common recipe)
    reference: str | None = None  # the run the report's position gaps are taken against

    def __post_init__(self):
        names = [r.name for r in self.runs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"study {self.name}: run names must be unique, repeated: {dup}")
        if self.reference is not None and self.reference not in names:
            raise ConfigError(f"study {self.name}: reference {self.reference!r} is not one of its runs {names}")

    def run_dir(self, run: StudyRun) -> Path:
        return Path(self.workdir) / run.name

    def lock(self, run: StudyRun) -> Path:
        return Path(self.workdir) / f"{run.name}.lock"

    def log(self, run: StudyRun) -> Path:
        return Path(self.workdir) / f"{run.name}.log"

    def train_config(self, run: StudyRun) -> TrainConfig:
        return apply_overrides(load_config_file(run.config), self.train_overrides(run))

    def train_overrides(self, run: StudyRun) -> list[str]:
        return [f"name={run.name}", *self.overrides, *run.overrides]

    def select(self, only: list[str] | None = None, stage: int | None = None) -> list[StudyRun]:
        known = {r.name for r in self.runs}
        unknown = sorted(set(only or ()) - known)
        if unknown:
            raise ConfigError(f"--only: unknown run(s) {unknown}; the study has {sorted(known)}")
        return [r for r in self.runs if (not only or r.name in only) and (stage is None or r.stage == stage)]


def load_study(path: str | Path) -> Study:
    import importlib.util

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"study file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"fibjax_study_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_study"):
        raise ConfigError(f"study file {str(path)!r} defines no get_study()")
    study = module.get_study()
    if not isinstance(study, Study):
        raise ConfigError(f"study file {str(path)!r}: get_study() returned {type(study).__name__}, not a Study")
    return study


# ---------------------------------------------------------------------------------------------
# Status


@dataclass
class RunStatus:
    run: StudyRun
    state: str  # done | running | to do
    step: int
    steps: int
    tokens_per_step: int
    tokens_per_s: float | None
    extra_evals_done: int = 0

    @property
    def tokens(self) -> int:
        return self.step * self.tokens_per_step

    def eta_s(self, fallback_tokens_per_s: float) -> float:
        rate = self.tokens_per_s or fallback_tokens_per_s
        return (self.steps - self.step) * self.tokens_per_step / rate


def _lock_pid(lock: Path) -> int | None:
    """The pid in the run's lock if that process is alive, else None."""
    try:
        pid = int(lock.read_text().strip())
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line of a killed run
                continue
    return rows


def run_status(study: Study, run: StudyRun) -> RunStatus:
    cfg = study.train_config(run)
    run_dir = study.run_dir(run)
    rows = _metrics(run_dir)
    step = max((r["step"] for r in rows if "loss" in r), default=0)
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    done = (run_dir / "eval" / f"{cfg.steps}.json").exists()
    extra = sum(1 for e in run.extra_evals if _extra_eval_path(run_dir, cfg.steps, e).exists())
    state = "done" if done and extra == len(run.extra_evals) else "running" if _lock_pid(study.lock(run)) else "to do"
    return RunStatus(run, state, step, cfg.steps, cfg.global_batch * cfg.seq_len, rates[-1] if rates else None, extra)


def _extra_eval_path(run_dir: Path, step: int, args: tuple[str, ...]) -> Path:
    return run_dir / "eval" / f"{step}-study-{'_'.join(a.strip('-').replace('=', '_').replace('/', '_') for a in args)}.json"


def format_status(study: Study, statuses: list[RunStatus], fallback_tokens_per_s: float = 6000.0) -> str:
    measured = sorted(s.tokens_per_s for s in statuses if s.tokens_per_s)
    if measured:  # the study's own measured speed beats a guess for the runs not started yet
        fallback_tokens_per_s = measured[len(measured) // 2]
    lines = [
        f"study {study.name}: {study.workdir} -> {study.results}",
        "| run | stage | state | step | tokens | tok/s | ETA |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    left = 0.0
    for s in statuses:
        eta = 0.0 if s.state == "done" else s.eta_s(fallback_tokens_per_s)
        left += eta
        rate = f"{s.tokens_per_s:,.0f}" if s.tokens_per_s else "—"
        state = f"{s.state} (restored)" if s.state == "done" and (study.run_dir(s.run) / RESTORED).exists() else s.state
        lines.append(
            f"| {s.run.name} | {s.run.stage} | {state} | {s.step}/{s.steps} | {s.tokens / 1e6:.1f}M/{s.steps * s.tokens_per_step / 1e6:.1f}M "
            f"| {rate} | {_hm(eta) if s.state != 'done' else '—'} |"
        )
    done = sum(s.state == "done" for s in statuses)
    lines.append(
        f"{done}/{len(statuses)} done; training left: about {_hm(left)} "
        f"(measured tok/s; runs not started at {fallback_tokens_per_s:,.0f}, {'the median measured here' if measured else 'a guess'}; "
        "evaluation adds a few minutes a run)"
    )
    return "\n".join(lines)


def _hm(seconds: float) -> str:
    m = int(round(seconds / 60))
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m"


# ---------------------------------------------------------------------------------------------
# Running


class StudyError(RuntimeError):
    pass


class StudyStopped(RuntimeError):
    """A child was stopped by a signal (the study stops too; run it again to resume)."""


def _child(cmd: list[str], log: Path) -> int:
    """Run one fibjax command, its output appended to ``log``; SIGTERM/SIGINT are passed on so
    the child saves a checkpoint before the study exits."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        forward = lambda signum, _frame: proc.send_signal(signum)  # noqa: E731
        old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return proc.wait()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def train_command(study: Study, run: StudyRun) -> list[str]:
    return [
        sys.executable,
        "-m",
        "launch.train",
        "--config",
        run.config,
        "--workdir",
        str(study.run_dir(run)),
        "--no-progress",
        *study.train_overrides(run),
        "eval.at_end=false",
    ]


def run_one(study: Study, run: StudyRun, say=print) -> None:
    """Train (or resume) and evaluate one run; nothing is redone that is already on disk."""
    cfg = study.train_config(run)
    run_dir = study.run_dir(run)
    lock, log = study.lock(run), study.log(run)
    lock.parent.mkdir(parents=True, exist_ok=True)
    pid = _lock_pid(lock)
    if pid is not None:
        raise StudyError(f"{run.name} is already being run by process {pid} ({lock})")
    lock.write_text(str(os.getpid()))
    try:
        if not (run_dir / "eval" / f"{cfg.steps}.json").exists():
            started = time.time()
            say(f"[{run.name}] training to step {cfg.steps} (log: {log})")
            code = _child(train_command(study, run), log)
            if code == 3:
                raise StudyStopped(f"{run.name} was stopped before its last step; run the study again to resume it")
            if code != 0:
                raise StudyError(f"{run.name}: training failed (exit {code}); see {log}")
            say(f"[{run.name}] trained in {_hm(time.time() - started)}; evaluating")
            code = _child([sys.executable, "-m", "launch.eval", "--workdir", str(run_dir), "--step", str(cfg.steps)], log)
            if code != 0:
                raise StudyError(f"{run.name}: evaluation failed (exit {code}); see {log}")
        for args in run.extra_evals:
            path = _extra_eval_path(run_dir, cfg.steps, args)
            if path.exists():
                continue
            say(f"[{run.name}] evaluating {' '.join(args)}")
            before = set((run_dir / "eval").glob("*.json"))
            code = _child([sys.executable, "-m", "launch.eval", "--workdir", str(run_dir), "--step", str(cfg.steps), *args], log)
            if code != 0:
                raise StudyError(f"{run.name}: evaluation {' '.join(args)} failed (exit {code}); see {log}")
            new = sorted(set((run_dir / "eval").glob("*.json")) - before, key=lambda p: p.stat().st_mtime)
            if new:  # keep the study's own name for it, so "done" is decidable
                new[-1].rename(path)
    finally:
        lock.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Results

RESTORED = "RESTORED"  # marker file in a run directory rebuilt from the study's record


def restore_recorded(study: Study, say=print) -> list[str]:
    """Rebuild the directory of every run that ``RESULTS/study.json`` records as done and this
    machine lacks (eval files plus the recorded curves as metrics.jsonl). A record is used only
    if it was made with the run's present config and overrides; an existing directory (a local
    run, finished or not) is never touched. Returns the restored names."""
    path = Path(study.results) / "study.json"
    if not path.exists():
        return []
    try:
        recorded = json.loads(path.read_text()).get("runs", {})
    except (json.JSONDecodeError, AttributeError) as e:
        raise StudyError(f"{path}: not a study summary ({e}); fix or delete it") from e
    restored = []
    for run in study.runs:
        entry, run_dir = recorded.get(run.name), study.run_dir(run)
        if not entry or entry.get("state") != "done" or not entry.get("evals") or run_dir.exists():
            continue
        cfg = study.train_config(run)
        if (entry.get("config"), entry.get("overrides"), entry.get("steps")) != (run.config, study.train_overrides(run), cfg.steps):
            say(f"[{run.name}] {path} records it with another config, overrides or steps; not restored (it will be trained)")
            continue
        (run_dir / "eval").mkdir(parents=True)
        for name, report in entry["evals"].items():
            (run_dir / "eval" / Path(name).name).write_text(json.dumps(report, indent=1) + "\n")
        rows = sorted(entry.get("train_curve", []) + entry.get("val_curve", []), key=lambda r: r["step"])
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / RESTORED).write_text(f"rebuilt from {path}: eval files and curves only (training curve every 10 steps), no checkpoints\n")
        restored.append(run.name)
    if restored:
        say(f"restored from {path} (trained elsewhere, no checkpoints here): {', '.join(restored)}")
    return restored


def _summary_of(report: dict) -> dict:
    """An evaluation report with the error law's scatter points only where the plot draws them
    (one dataset at one length; the rest stay in the run's own eval file), so that study.json
    stays small enough to commit and a run restored from it draws the same error_law.png."""
    from fibjax.eval.error_law import plotted

    where = plotted(report)
    if where is None:
        return report

    def layers(dataset: str, length: str, fits: list[dict]) -> list[dict]:
        return fits if (dataset, length) == where else [{k: v for k, v in fit.items() if k != "points"} for fit in fits]

    law = report["error_law"]
    return {**report, "error_law": {ds: {n: layers(ds, n, fits) for n, fits in by_len.items()} for ds, by_len in law.items()}}


def write_results(study: Study, say=print) -> Path | None:
    """The report of every finished run (tables, plots) and study.json in ``study.results``."""
    from fibjax.eval.report import ReportError, build_report

    out = Path(study.results)
    statuses = {r.name: run_status(study, r) for r in study.runs}  # each reads the run's metrics once
    finished = [r for r in study.runs if statuses[r.name].state == "done"]
    if not finished:
        say("no finished run yet: nothing to report")
        return None
    ref = study.reference if study.reference in {r.name for r in finished} else None
    # a run's extra evaluations (sparse inference, RoPE scaling) are rows of their own, "RUN [tag]"
    paths = [p for r in finished for p in (study.run_dir(r), *(_extra_eval_path(study.run_dir(r), statuses[r.name].steps, e) for e in r.extra_evals))]
    try:
        build_report(paths, out, reference=ref)
    except ReportError as e:
        raise StudyError(f"the report could not be built: {e}") from e
    summary = {"study": study.name, "overrides": list(study.overrides), "reference": ref, "runs": {}}
    for r in study.runs:
        s = statuses[r.name]
        entry = {
            "config": r.config,
            "overrides": study.train_overrides(r),
            "stage": r.stage,
            "state": s.state,
            "step": s.step,
            "steps": s.steps,
            "tokens": s.tokens,
        }
        if s.state == "done":
            run_dir = study.run_dir(r)
            evals = sorted((run_dir / "eval").glob(f"{s.steps}*.json"))
            entry["evals"] = {p.name: _summary_of(json.loads(p.read_text())) for p in evals}
            rows = _metrics(run_dir)
            entry["val_curve"] = [r_ for r_ in rows if any(k.startswith("val/") for k in r_)]
            entry["train_curve"] = [{k: r_[k] for k in ("step", "loss", "ce") if k in r_} for r_ in rows if "loss" in r_ and r_["step"] % 10 == 0]
        summary["runs"][r.name] = entry
    path = out / "study.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    say(f"report: {out / 'report.md'} ({len(finished)} runs); summary: {path}")
    return path
