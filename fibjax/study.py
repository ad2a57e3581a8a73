"""A study: named runs that differ only in attention (or seed), trained, evaluated and reported.

A study file (``configs/study/*.py``) defines ``get_study() -> Study``. Every step is an
ordinary fibjax command run as a child process (``launch.train``, ``launch.eval``) or the
report machinery (``fibjax.eval.report``), so a study is resumable exactly as they are: a
finished run is skipped, an unfinished one resumes from its last checkpoint.

A run is *done* when its evaluation file ``RUN/eval/<steps>.json`` exists; *running* while
``<name>.lock`` beside its directory names a live process; otherwise it is *to do* (from the
step of its latest checkpoint). The children's output goes to ``<name>.log`` beside it too, and
their wall times to ``RUN/study_time.json``.

A study outlives the machine it ran on: ``RESULTS/study.json`` (small, committed) keeps every
finished run's evaluation files and curves. On a machine without a run's directory,
``restore_recorded`` writes them back into it, so the run counts as done and stays in the
report instead of being trained again (its checkpoints are not kept, so nothing more can be
evaluated from it there).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fibjax.config import ConfigError, TrainConfig, apply_overrides, find_config_file, load_config_file
from fibjax.errors import FibjaxError
from fibjax.eval.groups import FigureGroup
from fibjax.eval.paired import Comparison
from fibjax.eval.seed_table import SeedTable
from fibjax.eval.token_curve import TokenCurve
from fibjax.eval.trend import Trend
from fibjax.run.curves import METRICS_FILE, curve_values

# Tokens per second assumed for a run when the study has measured none: dense_seed43 trained at
# 2.66k tokens/s on an idle 2-core machine (BUILD_NOTES, "The CPU study").
GUESS_TOKENS_PER_S = 2700.0


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
    # paired tests across seeds, each "a - b" between two models named by their config files
    comparisons: tuple[Comparison, ...] = ()
    # extrapolation against the training length, each a line of runs (``fibjax.eval.trend``)
    trends: tuple[Trend, ...] = ()
    # the report's perplexity-vs-length and NLL-by-position figures, one per group of runs
    # (``fibjax.eval.groups.FigureGroup``); none: one figure of every run
    figures: tuple[FigureGroup, ...] = ()
    # runs followed against tokens seen, with differences between them (``fibjax.eval.token_curve``)
    token_curves: tuple[TokenCurve, ...] = ()
    # runs and their evaluations side by side at several lengths, over seeds (``fibjax.eval.seed_table``)
    seed_tables: tuple[SeedTable, ...] = ()

    def __post_init__(self):
        names = [r.name for r in self.runs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"study {self.name}: run names must be unique, repeated: {dup}")
        declared = (
            ("trends", {n for t in self.trends for n in t.runs}),
            ("figures", {n for g in self.figures for n in g.runs}),
            ("token_curves", {n for c in self.token_curves for n in c.runs}),
            ("seed_tables", {n for t in self.seed_tables for n in t.run_names()}),
        )
        for what, named in declared:
            unknown = sorted(named - set(names))
            if unknown:
                raise ConfigError(f"study {self.name}: {what} name runs it does not have: {unknown}")
        if self.reference is not None and self.reference not in names:
            raise ConfigError(f"study {self.name}: reference {self.reference!r} is not one of its runs {names}")
        by_name = {r.name: r for r in self.runs}
        for table in self.seed_tables:
            for row in table.rows:
                for seed in table.row_seeds(row):
                    run = by_name[row.run_name(seed)]
                    if row.evaluation and row.evaluation not in run.extra_evals:
                        where = f"study {self.name}: seed table {table.name}, row {row.label!r}"
                        raise ConfigError(f"{where}: {run.name} has no extra evaluation {list(row.evaluation)}")

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

    def model_and_seed(self, run: StudyRun) -> tuple[str, int] | None:
        """(config file, seed) of a run that differs from its model's other runs only by seed;
        None for a run with other overrides of its own (a continuation, say)."""
        if any(not o.startswith("seed=") for o in run.overrides):
            return None
        return run.config, self.train_config(run).seed

    def select(self, only: list[str] | None = None, stage: int | None = None) -> list[StudyRun]:
        known = {r.name for r in self.runs}
        unknown = sorted(set(only or ()) - known)
        if unknown:
            raise ConfigError(f"--only: unknown run(s) {unknown}; the study has {sorted(known)}")
        return [r for r in self.runs if (not only or r.name in only) and (stage is None or r.stage == stage)]


def load_study(path: str | Path) -> Study:
    import importlib.util

    path = find_config_file(path)  # configs/study/... also from an installed wheel
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
    tokens_per_s: float | None  # the median of the run's measured steps (or its record's)
    extra_evals_done: int = 0
    recorded: bool = False  # done according to the study's record, with no directory here
    missing_data: str | None = None  # the data directory a run still to train needs and lacks

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
    path = run_dir / METRICS_FILE
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line of a killed run
                continue
    return rows


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def run_status(study: Study, run: StudyRun, record: dict | None = None) -> RunStatus:
    """The run's state from its directory; with ``record`` (``read_record``), a run this
    machine lacks counts as done if the record says so. Reads only: nothing is written."""
    cfg = study.train_config(run)
    run_dir = study.run_dir(run)
    tokens_per_step = cfg.global_batch * cfg.seq_len
    entry = (record or {}).get(run.name)
    if entry is not None and not run_dir.exists():
        return RunStatus(run, "done", cfg.steps, cfg.steps, tokens_per_step, entry.get("tokens_per_s"), len(run.extra_evals), recorded=True)
    rows = _metrics(run_dir)
    step = max((r["step"] for r in rows if "loss" in r), default=0)
    rate = _median([r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 1])  # step 1 compiles
    if rate is None:
        rate = _timing(run_dir).get("tokens_per_s")
    done = (run_dir / "eval" / f"{cfg.steps}.json").exists()
    extra = sum(1 for e in run.extra_evals if _extra_eval_path(run_dir, cfg.steps, e).exists())
    state = "done" if done and extra == len(run.extra_evals) else "running" if _lock_pid(study.lock(run)) else "to do"
    missing = None
    if state != "done" and cfg.data.path and not Path(cfg.data.path).is_dir():
        missing = cfg.data.path
    return RunStatus(run, state, step, cfg.steps, tokens_per_step, rate, extra, missing_data=missing)


def _timing(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / TIMING).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _extra_eval_path(run_dir: Path, step: int, args: tuple[str, ...]) -> Path:
    return run_dir / "eval" / f"{step}-study-{'_'.join(a.strip('-').replace('=', '_').replace('/', '_') for a in args)}.json"


def format_status(study: Study, statuses: list[RunStatus], fallback_tokens_per_s: float = GUESS_TOKENS_PER_S) -> str:
    # the study's own measured speed (its finished runs first) beats a guess for the runs not started yet
    finished = [s.tokens_per_s for s in statuses if s.tokens_per_s and s.state == "done"]
    measured = finished or [s.tokens_per_s for s in statuses if s.tokens_per_s]
    if measured:
        fallback_tokens_per_s = _median(measured)
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
        restored = s.recorded or (s.state == "done" and (study.run_dir(s.run) / RESTORED).exists())
        state = f"{s.state} (restored)" if restored else s.state
        if s.state != "done" and (study.run_dir(s.run) / RESTORED).exists():
            state = f"{s.state} (restored without checkpoints: --retrain)"
        if s.missing_data:
            state += f"; data missing: {s.missing_data}"
        lines.append(
            f"| {s.run.name} | {s.run.stage} | {state} | {s.step}/{s.steps} | {s.tokens / 1e6:.1f}M/{s.steps * s.tokens_per_step / 1e6:.1f}M "
            f"| {rate} | {_hm(eta) if s.state != 'done' else '—'} |"
        )
    done = sum(s.state == "done" for s in statuses)
    source = "the median of its finished runs" if finished else "the median measured so far" if measured else "a guess: an idle 2-core CPU"
    lines.append(
        f"{done}/{len(statuses)} done; training left: about {_hm(left)} "
        f"(each run at its own measured tok/s; runs not started at {fallback_tokens_per_s:,.0f} tok/s, {source}; "
        "evaluation adds a few minutes a run)"
    )
    missing = sorted({s.missing_data for s in statuses if s.missing_data})
    if missing:
        where = "docs/guides/your-own-data.md \"5. The papers' and the CPU study's data\""
        lines.append(f"data missing: {', '.join(missing)}: prepare it first ({where}); those runs would fail at start")
    return "\n".join(lines)


def _hm(seconds: float) -> str:
    m = int(round(seconds / 60))
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m"


# ---------------------------------------------------------------------------------------------
# Running


class StudyError(FibjaxError, RuntimeError):
    pass


class StudyStopped(FibjaxError, RuntimeError):
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
    if (run_dir / RESTORED).exists():  # the record's curves and evaluations, no checkpoint to evaluate
        raise StudyError(
            f"{run.name} was restored from {study.results}/study.json without checkpoints and still needs an evaluation "
            f"(one added to the study since it was trained); `--retrain --only {run.name}` trains it again here"
        )
    _count_killed_session(run_dir, lock)
    lock.write_text(str(os.getpid()))
    try:
        if not (run_dir / "eval" / f"{cfg.steps}.json").exists():
            started = time.time()
            say(f"[{run.name}] training to step {cfg.steps} (log: {log})")
            code = _child(train_command(study, run), log)
            _add_time(run_dir, "train_s", time.time() - started)  # summed over resumes
            if code == 3:
                raise StudyStopped(f"{run.name} was stopped before its last step; run the study again to resume it")
            if code != 0:
                raise StudyError(f"{run.name}: training failed (exit {code}); see {log}")
            say(f"[{run.name}] trained in {_hm(time.time() - started)}; evaluating")
            started = time.time()
            code = _child([sys.executable, "-m", "launch.eval", "--workdir", str(run_dir), "--step", str(cfg.steps)], log)
            _add_time(run_dir, "eval_s", time.time() - started)
            if code != 0:
                raise StudyError(f"{run.name}: evaluation failed (exit {code}); see {log}")
        for args in run.extra_evals:
            path = _extra_eval_path(run_dir, cfg.steps, args)
            if path.exists():
                continue
            say(f"[{run.name}] evaluating {' '.join(args)}")
            started = time.time()
            tag = path.stem.split("-", 1)[1]  # the study's own name for it, so "done" is decidable
            code = _child([sys.executable, "-m", "launch.eval", "--workdir", str(run_dir), "--step", str(cfg.steps), *args, "--tag", tag], log)
            _add_time(run_dir, "eval_s", time.time() - started)
            if code != 0:
                raise StudyError(f"{run.name}: evaluation {' '.join(args)} failed (exit {code}); see {log}")
    finally:
        lock.unlink(missing_ok=True)


def _count_killed_session(run_dir: Path, lock: Path) -> None:
    """A lock left by a killed study (SIGKILL, the machine's session ending) means its training
    time was never added: add it, from the lock's writing to the run's last write of its metrics,
    so ``train_s`` covers every session of a resumed run, not only the last."""
    metrics = run_dir / METRICS_FILE
    if lock.exists() and metrics.exists():
        _add_time(run_dir, "train_s", max(0.0, metrics.stat().st_mtime - lock.stat().st_mtime))


def _add_time(run_dir: Path, key: str, seconds: float) -> None:
    if not run_dir.is_dir():
        return
    timing = _timing(run_dir)
    timing[key] = round(timing.get(key, 0.0) + seconds, 1)
    (run_dir / TIMING).write_text(json.dumps(timing) + "\n")


# ---------------------------------------------------------------------------------------------
# Results

RESTORED = "RESTORED"  # marker file in a run directory rebuilt from the study's record
TIMING = "study_time.json"  # wall seconds of the study's training and evaluation children


def read_record(study: Study, say=print) -> dict[str, dict]:
    """The entries of ``RESULTS/study.json`` for runs it records as done with the run's present
    config, overrides and steps (a record of another recipe is ignored, saying so). Reads only."""
    path = Path(study.results) / "study.json"
    if not path.exists():
        return {}
    try:
        recorded = json.loads(path.read_text()).get("runs", {})
    except (json.JSONDecodeError, AttributeError) as e:
        raise StudyError(f"{path}: not a study summary ({e}); fix or delete it") from e
    usable = {}
    for run in study.runs:
        entry = recorded.get(run.name)
        if not entry or entry.get("state") != "done" or not entry.get("evals"):
            continue
        cfg = study.train_config(run)
        if (entry.get("config"), entry.get("overrides"), entry.get("steps")) != (run.config, study.train_overrides(run), cfg.steps):
            if not study.run_dir(run).exists():
                say(f"[{run.name}] {path} records it with another config, overrides or steps; not restored (it will be trained)")
            continue
        usable[run.name] = entry
    return usable


def restore_recorded(study: Study, say=print) -> list[str]:
    """Rebuild the directory of every run that ``RESULTS/study.json`` records as done and this
    machine lacks (eval files plus the recorded curves as metrics.jsonl). A record is used only
    if it was made with the run's present config and overrides; an existing directory (a local
    run, finished or not) is never touched. Returns the restored names."""
    path = Path(study.results) / "study.json"
    restored = []
    for name, entry in read_record(study, say).items():
        run_dir = study.run_dir(next(r for r in study.runs if r.name == name))
        if run_dir.exists():
            continue
        (run_dir / "eval").mkdir(parents=True)
        for file_name, report in entry["evals"].items():
            (run_dir / "eval" / Path(file_name).name).write_text(json.dumps(report, indent=1) + "\n")
        rows = sorted(entry.get("train_curve", []) + entry.get("val_curve", []), key=lambda r: r["step"])
        (run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
        timing = {k: entry[k] for k in ("train_s", "eval_s", "tokens_per_s") if entry.get(k) is not None}
        if timing:
            (run_dir / TIMING).write_text(json.dumps(timing) + "\n")
        (run_dir / RESTORED).write_text(f"rebuilt from {path}: eval files and curves only (training curve every 10 steps), no checkpoints\n")
        restored.append(name)
    if restored:
        say(f"restored from {path} (trained elsewhere, no checkpoints here): {', '.join(restored)}")
    return restored


def set_aside_restored(study: Study, run: StudyRun, say=print) -> Path | None:
    """Move a restored run's directory (curves and eval files rebuilt from ``study.json``, no
    checkpoints) to ``NAME.restored`` so that the run is trained again here: the way to get back
    a checkpoint that only another machine had. A directory with real training in it is never
    moved; returns the new path, or None when there was nothing restored to move."""
    run_dir = study.run_dir(run)
    if not (run_dir / RESTORED).exists():
        return None
    if (run_dir / "checkpoints").exists():
        raise StudyError(f"{run_dir} has both a {RESTORED} marker and checkpoints; remove one by hand")
    aside = run_dir.with_name(run_dir.name + RESTORED_ASIDE)
    if aside.exists():
        shutil.rmtree(aside)  # an older copy of the same record
    run_dir.rename(aside)
    say(f"[{run.name}] restored copy moved to {aside}; training it again")
    return aside


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
    dirs = {r.name: d for r in study.runs if (d := report_dir(study, r, statuses[r.name])) is not None}
    finished = [r for r in study.runs if r.name in dirs]
    if not finished:
        say("no finished run yet: nothing to report")
        return None
    ref = study.reference if study.reference in {r.name for r in finished} else None
    # a run's extra evaluations (sparse inference, RoPE scaling) are rows of their own, "RUN [tag]"
    paths = [p for r in finished for p in (dirs[r.name], *(_extra_eval_path(dirs[r.name], statuses[r.name].steps, e) for e in r.extra_evals)) if p.exists()]
    try:
        build_report(paths, out, reference=ref, groups=study.figures)
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
        if r.name in dirs:
            run_dir = dirs[r.name]
            timing = _timing(run_dir)
            if s.state != "done":  # the record's run, kept while this machine lacks or retrains it
                missing = [p.name for e in r.extra_evals if not (p := _extra_eval_path(run_dir, s.steps, e)).exists()]
                entry.update({"state": "done", "step": s.steps, "tokens": s.steps * s.tokens_per_step, **({"evals_missing": missing} if missing else {})})
            entry.update({"tokens_per_s": timing.get("tokens_per_s", s.tokens_per_s), "train_s": timing.get("train_s"), "eval_s": timing.get("eval_s")})
            evals = sorted((run_dir / "eval").glob(f"{s.steps}*.json"))
            entry["evals"] = {p.name: _summary_of(json.loads(p.read_text())) for p in evals}
            rows = _metrics(run_dir)
            entry["val_curve"] = [r_ for r_ in rows if curve_values(r_)]
            entry["train_curve"] = [{k: r_[k] for k in ("step", "loss", "ce") if k in r_} for r_ in rows if "loss" in r_ and r_["step"] % 10 == 0]
        summary["runs"][r.name] = entry
    path = out / "study.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    if study.comparisons:
        _write_paired(study, finished, statuses, dirs, out)
    if study.trends:
        _write_trend(study, finished, statuses, dirs, out)
    for curve in study.token_curves:
        _write_token_curve(study, curve, statuses, dirs, out)
    for table in study.seed_tables:
        _write_seed_table(study, table, statuses, dirs, out)
    say(f"report: {out / 'report.md'} ({len(finished)} runs); summary: {path}")
    return path


RESTORED_ASIDE = ".restored"  # suffix of a restored run's directory set aside by ``--retrain``


def report_dir(study: Study, run: StudyRun, status: RunStatus) -> Path | None:
    """Where the report and the record read a run from: its directory when it is done; a run
    known only from the record stays in both until it is done here: its restored directory (when
    the study has since added an evaluation it lacks) or, while ``--retrain`` trains it again,
    the restored copy set aside beside it. None: nothing to report yet."""
    run_dir = study.run_dir(run)
    if status.state == "done":
        return run_dir
    for candidate in (run_dir, run_dir.with_name(run_dir.name + RESTORED_ASIDE)):
        if (candidate / RESTORED).exists() and (candidate / "eval" / f"{status.steps}.json").exists():
            return candidate
    return None


def _plain_evals(study: Study, run: StudyRun, steps: int, run_dir: Path | None = None) -> list[Path]:
    """The run's evaluations under its own attention and RoPE: the main one, then the extra ones
    that only change the lengths (same scored tokens, so their NLLs are comparable)."""
    run_dir = run_dir or study.run_dir(run)
    extra = [_extra_eval_path(run_dir, steps, e) for e in run.extra_evals if len(e) == 2 and e[0] == "--lengths"]
    return [p for p in (run_dir / "eval" / f"{steps}.json", *extra) if p.exists()]


def paired_nlls(study: Study, runs: list[StudyRun], statuses: dict[str, RunStatus], dirs: dict[str, Path] | None = None) -> dict:
    """nll[model][seed][dataset][length] of every finished run that differs from its model's
    other runs only by seed (``Study.model_and_seed``)."""
    nlls: dict = {}
    for run in runs:
        key = study.model_and_seed(run)
        if key is None:
            continue
        model, seed = key
        nlls.setdefault(model, {})[seed] = run_nlls(study, run, statuses[run.name].steps, (dirs or {}).get(run.name))
    return nlls


def run_nlls(study: Study, run: StudyRun, steps: int, run_dir: Path | None = None) -> dict[str, dict[int, float]]:
    """nll[dataset][length] of a run's plain evaluations (``_plain_evals``)."""
    return eval_nlls(_plain_evals(study, run, steps, run_dir))


def eval_nlls(paths: list[Path]) -> dict[str, dict[int, float]]:
    """The NLLs of evaluation files, read together.

    Args:
        paths: ``launch.eval`` report files, the one whose figure wins first.

    Returns:
        nll[dataset][length]; where two files share a length, the first one's figure.
    """
    nll: dict = {}
    for path in paths:
        for dataset, rows in json.loads(path.read_text())["datasets"].items():
            for row in rows:
                nll.setdefault(dataset, {}).setdefault(int(row["length"]), float(row["nll"]))
    return nll


def _write_paired(study: Study, finished: list[StudyRun], statuses: dict[str, RunStatus], dirs: dict[str, Path], out: Path) -> None:
    """paired.csv, paired.png and the report's section on the study's paired comparisons."""
    from fibjax.eval import paired

    results = paired.paired(paired_nlls(study, finished, statuses, dirs), study.comparisons)
    if not results:
        return
    first = next(r for r in finished if (study.model_and_seed(r) or ("",))[0] == study.comparisons[0].a)
    train_len = study.train_config(first).seq_len
    paired.write_csv(results, out / "paired.csv")
    figure = paired.plot(results, out / "paired.png", train_len)
    section = "\n## Paired tests across seeds\n\n" + paired.markdown(results, train_len) + "\n"
    if figure is not None:
        section += f"\n![paired differences]({figure.name})\n"
    with (out / "report.md").open("a") as f:
        f.write(section)


def _write_trend(study: Study, finished: list[StudyRun], statuses: dict[str, RunStatus], dirs: dict[str, Path], out: Path) -> None:
    """length_trend.csv, length_trend.png and the report's section on the study's length trends."""
    from fibjax.eval import plots, trend

    named = {n for t in study.trends for n in t.runs}
    runs = {r.name: (study.train_config(r).seq_len, run_nlls(study, r, statuses[r.name].steps, dirs[r.name])) for r in finished if r.name in named}
    if not runs:
        return
    datasets = sorted(set.intersection(*(set(nll) for _, nll in runs.values())))
    pts = trend.points(study.trends, runs, datasets)
    if not pts:
        return
    trend.write_csv(pts, out / "length_trend.csv")
    section = "\n## Extrapolation against the training length\n\n" + trend.markdown(pts, datasets) + "\n"
    if plots.plot_length_trend(pts, out / "length_trend.png"):
        section += "\n![length trend](length_trend.png)\n"
    with (out / "report.md").open("a") as f:
        f.write(section)


def _write_token_curve(study: Study, curve: TokenCurve, statuses: dict[str, RunStatus], dirs: dict[str, Path], out: Path) -> None:
    """token_curve_NAME.csv / .png and the report's section on ``curve``: finished runs from where
    the report reads them, a run still training from its directory up to its last point."""
    from fibjax.eval import token_curve

    metrics, states = {}, {}
    for name in curve.runs:
        s = statuses[name]
        run_dir = dirs.get(name) or study.run_dir(s.run)
        if rows := _metrics(run_dir):
            metrics[name] = rows
            states[name] = "done" if name in dirs else f"training, step {s.step} of {s.steps}"
    run_pts, diff_pts = token_curve.points(curve, metrics)
    if not run_pts:
        return
    token_curve.write_csv(curve, run_pts, diff_pts, states, out / f"token_curve_{curve.name}.csv")
    section = f"\n## Against tokens seen: {curve.title}\n\n" + token_curve.markdown(curve, run_pts, diff_pts, states) + "\n"
    if (figure := token_curve.plot(curve, run_pts, diff_pts, out / f"token_curve_{curve.name}.png")) is not None:
        section += f"\n![against tokens seen]({figure.name})\n"
    with (out / "report.md").open("a") as f:
        f.write(section)


def _write_seed_table(study: Study, table: SeedTable, statuses: dict[str, RunStatus], dirs: dict[str, Path], out: Path) -> None:
    """seed_table_NAME.csv and the report's section on ``table``, from the finished runs it names."""
    from fibjax.eval import seed_table

    nlls: dict = {}
    for row in table.rows:
        for seed in table.row_seeds(row):
            name = row.run_name(seed)
            if (run_dir := dirs.get(name)) is None:
                continue
            status = statuses[name]
            if not row.evaluation:
                nlls.setdefault(row.label, {})[seed] = run_nlls(study, status.run, status.steps, run_dir)
            elif (path := _extra_eval_path(run_dir, status.steps, row.evaluation)).exists():
                nlls.setdefault(row.label, {})[seed] = eval_nlls([path])
    if not nlls:
        return
    datasets = sorted({ds for by_seed in nlls.values() for nll in by_seed.values() for ds in nll})
    seed_table.write_csv(table, nlls, datasets, out / f"seed_table_{table.name}.csv")
    section = f"\n## {table.title}\n\n" + seed_table.markdown(table, nlls, datasets) + "\n"
    with (out / "report.md").open("a") as f:
        f.write(section)
