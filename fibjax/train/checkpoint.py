"""Checkpoints (the only module that imports Orbax): train state + data-iterator state.

Orbax writes each step into a temporary directory and renames it when complete, so a save
interrupted half-way never touches the previous checkpoint; keep-last-K deletes only older,
finished steps. Orbax does not notice changed bytes (its zstd frames carry no checksum), so
every finished step gets the sha256 of each of its files (``<step>/fibjax.sha256.json``),
checked before a restore, and restored arrays must be finite. A failed asynchronous save is
reported by the next ``poll()`` (the loop polls every step), as one CheckpointError. The
run's resolved config sits beside the steps (``config.json``) and is compared on every resume.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from fibjax.config import CheckpointConfig, TrainConfig, from_dict, to_dict
from fibjax.data.token_files import file_sha256, free_space, human_bytes, write_json_atomically

CONFIG_FILE = "config.json"
TOKENIZER_PIN = "tokenizer.sha256"
SUMS_FILE = "fibjax.sha256.json"
# where --resume-step moves the steps after the one it resumes from (kept, not deleted)
SET_ASIDE_DIR = "checkpoints.set_aside"
# Fields a resumed run may change: how long and how often, and how the same step is computed
# (layout, activation checkpointing, scanned layers, loss chunks), not what is trained.
RESUMABLE_CHANGES = (
    "steps",
    "log_every",
    "checkpoint",
    "eval",
    "mesh",
    "data.worker_count",
    "data.prepare",
    "model.remat",
    "model.scan_layers",
    "model.logits_chunk",
)


# Keys renamed since a checkpoint may have been saved: saved name -> present name, wherever the
# key occurs in the state tree (the parameters and the optimizer's per-parameter moments alike).
# Restoring reads a checkpoint's own names and renames them, so earlier runs keep resuming.
RENAMED_KEYS = {"theta": "alpha_logit"}  # 2026-12-01: a learned layer's alpha parameter


def rename_keys(tree, mapping: dict[str, str]):
    """``tree`` with every dict key found in ``mapping`` renamed, at any depth (dicts, lists,
    tuples and NamedTuples such as optax's states are walked; everything else is a leaf)."""
    if isinstance(tree, dict):
        return {mapping.get(k, k) if isinstance(k, str) else k: rename_keys(v, mapping) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(rename_keys(v, mapping) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(rename_keys(v, mapping) for v in tree)
    return tree


def saved_renames(state_dir: Path) -> dict[str, str]:
    """The entries of RENAMED_KEYS whose old name the checkpoint at ``state_dir`` still uses
    (read from Orbax's metadata of the saved tree; {} when it cannot be read)."""
    try:
        tree = ocp.StandardCheckpointer().metadata(state_dir).item_metadata
    except Exception:  # a damaged or foreign checkpoint: the restore itself reports it
        return {}
    keys = {getattr(k, "key", None) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0] for k in path}
    return {old: new for old, new in RENAMED_KEYS.items() if old in keys}


class CheckpointError(RuntimeError):
    """A checkpoint or workdir cannot be used; the message says why and what to do."""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def changed_fields(a: TrainConfig, b: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Every dotted field whose value differs: {"model.rope_theta": (10000.0, 40000.0)}."""
    fa, fb = _flatten(to_dict(a)), _flatten(to_dict(b))
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def config_differences(saved: TrainConfig, current: TrainConfig) -> list[str]:
    """Fields that differ and may not change on resume, as 'field: saved -> current'."""
    allowed = lambda key: any(key == f or key.startswith(f + ".") for f in RESUMABLE_CHANGES)  # noqa: E731
    return [f"{k}: {a!r} (saved) vs {b!r} (now)" for k, (a, b) in changed_fields(saved, current).items() if not allowed(k)]


def check_workdir(workdir: Path, cfg: TrainConfig) -> TrainConfig | None:
    """The run already in ``workdir`` (None for a new run); writes nothing.

    Raises CheckpointError when the workdir holds a different run or files of something else."""
    path = Path(workdir) / CONFIG_FILE
    if not path.exists():
        if Path(workdir).is_dir() and any(Path(workdir).iterdir()):
            raise CheckpointError(f"workdir {workdir} is not empty and holds no fibjax run ({CONFIG_FILE} missing); use another --workdir")
        return None
    try:
        saved = from_dict(TrainConfig, json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path} is not a fibjax run config ({e}); use another --workdir") from None
    diff = config_differences(saved, cfg)
    if diff:
        raise CheckpointError(
            f"workdir {workdir} holds a run with a different config; nothing was changed. Differences:\n  "
            + "\n  ".join(diff)
            + "\nUse a new --workdir, or the same config to resume."
        )
    return saved


def claim_workdir(workdir: Path, cfg: TrainConfig) -> TrainConfig | None:
    """Record ``cfg`` in a new workdir, or check it against the run already there and record
    it again (steps etc. may have changed). Returns the saved config (None for a new run)."""
    saved = check_workdir(workdir, cfg)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    write_json_atomically(Path(workdir) / CONFIG_FILE, to_dict(cfg))
    return saved


def check_tokenizer_pin(workdir: Path, sha256: str) -> None:
    """The data still uses the tokenizer the run trained with (if it trained at all).

    A data directory prepared again (other inputs, another vocabulary) keeps its path but not
    its token ids; training on or evaluating with it would give wrong numbers silently."""
    pinned = pinned_tokenizer(workdir)
    if pinned is not None and pinned != sha256:
        raise CheckpointError(
            f"the run in {workdir} was trained with tokenizer sha256 {pinned[:12]}..., but its data directory now holds "
            f"{sha256[:12]}... (prepared again?); the token ids would not match. Point data.path at the original data."
        )


def pin_tokenizer(workdir: Path, sha256: str) -> None:
    """Record the tokenizer a run trains with, or check that the data still uses it."""
    check_tokenizer_pin(workdir, sha256)
    path = Path(workdir) / TOKENIZER_PIN
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(sha256 + "\n")
        os.replace(tmp, path)


def pinned_tokenizer(workdir: Path) -> str | None:
    """The tokenizer sha256 a run trained with (None for a run that never started training)."""
    path = Path(workdir) / TOKENIZER_PIN
    return path.read_text().strip() if path.exists() else None


def load_run_config(workdir: Path) -> TrainConfig:
    path = Path(workdir) / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{workdir} holds no fibjax run ({CONFIG_FILE} missing)")
    return from_dict(TrainConfig, json.loads(path.read_text()))


def finished_steps(workdir: Path) -> list[int]:
    """Steps with a complete checkpoint in ``workdir``, read without creating anything (Orbax
    names a step's directory by its number only once the step is complete)."""
    directory = Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) if directory.is_dir() else []


class DamagedCheckpoint(CheckpointError):
    """A step's files changed since they were saved, cannot be read, or hold non-finite numbers."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def error_reason(e: BaseException) -> str:
    """One short line for an exception from Orbax, TensorStore or the OS: the OS error where
    there is one (TensorStore gives it as os_error_code='28'), else the first line, cut short.
    TensorStore's own messages run to dozens of lines of JSON specs."""
    for cause in (e, e.__cause__, e.__context__):
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno)
        code = re.search(r"os_error_code='?(\d+)", str(cause)) if cause is not None else None
        if code:
            return os.strerror(int(code.group(1)))
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}{'...' if len(first) > 160 else ''}"


def _in_orbax(path: str, tb=None) -> bool:
    return any(f"{os.sep}orbax{os.sep}" in f for f in [path] + [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)])


def _drop_orbax_errors(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or not _in_orbax(record.pathname, record.exc_info[2] if record.exc_info else None)


def _quiet_orbax_failures() -> None:
    """Orbax reports one failed background save many times: absl log records, asyncio's "Task
    exception was never retrieved", uncaught exceptions in its threads, each with a traceback
    (~2,000 lines for one full disk). The Checkpointer reports each failure once, as a
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
        # its closed event loop (one traceback per write); TensorStore reports it as unraisable
        late = args.exc_type is RuntimeError and str(args.exc_value) == "Event loop is closed"
        if not (late and any(frame.f_code.co_name == "call_soon_threadsafe" for frame, _ in traceback.walk_tb(args.exc_traceback))):
            previous_unraisable_hook(args)

    threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook


_quiet = False


def _size(directory: Path) -> str:
    return human_bytes(sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()))


def record_checksums(step_dir: Path) -> None:
    """Write the sha256 of every file of a finished step into the step (about 1.4 GB/s)."""
    sums = {str(f.relative_to(step_dir)): file_sha256(f) for f in sorted(step_dir.rglob("*")) if f.is_file() and not f.name.startswith(SUMS_FILE)}
    write_json_atomically(step_dir / SUMS_FILE, sums)


def checksum_problem(step_dir: Path) -> str | None:
    """What changed in a step since it was saved (None: nothing, or no sums were recorded)."""
    path = step_dir / SUMS_FILE
    if not path.is_file():
        return None
    try:
        sums = json.loads(path.read_text())
    except ValueError:
        return f"its checksum record {SUMS_FILE} is unreadable"
    missing = [f for f in sums if not (step_dir / f).is_file()]
    changed = [f for f in sums if f not in missing and file_sha256(step_dir / f) != sums[f]]
    what = [f"{len(x)} file(s) {how}, e.g. {x[0]}" for x, how in ((changed, "changed since the save (sha256)"), (missing, "missing")) if x]
    return "; ".join(what) or None


def non_finite_arrays(tree) -> list[str]:
    """Paths of the floating-point arrays of ``tree`` that hold a NaN or an infinity."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(path) for path, x in leaves if jnp.issubdtype(x.dtype, jnp.inexact) and not bool(jnp.isfinite(x).all())]


class Checkpointer:
    """Save / restore {state, data iterator} under ``<workdir>/checkpoints``."""

    def __init__(self, workdir: Path, cfg: CheckpointConfig):
        self.directory = Path(workdir).resolve() / "checkpoints"
        self.set_aside_directory = self.directory.parent / SET_ASIDE_DIR
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._unchecked: int | None = None  # the step of the last save, until its result is checked
        _quiet_orbax_failures()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_iterator=None, *, wait: bool = False) -> None:
        self.wait()  # the previous save first, so that its failure is reported as its own
        items = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            raise self._save_failed(step, e) from None
        self._unchecked = step
        if wait:
            self.wait()

    def poll(self) -> None:
        """Check the last save as soon as it has finished in the background: raise CheckpointError
        if it failed, record its checksums if it succeeded. While a save runs this reads a flag
        under a lock (measured: 5 us a call; 0.05 us with no save pending): cheap every step."""
        if self._unchecked is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Wait for the last save and check it, as ``poll``."""
        step, self._unchecked = self._unchecked, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(step, e) from None
        if step is not None and jax.process_index() == 0:
            try:
                record_checksums(self.directory / str(step))
            except OSError as e:
                raise self._save_failed(step, e) from None

    def _save_failed(self, step: int | None, e: Exception) -> CheckpointError:
        # the failed step's half-written directory is useless (Orbax ignores it) and holds the
        # space the metrics and events still need to be flushed
        if jax.process_index() == 0:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        good = [s for s in finished_steps(self.directory.parent) if s != step]
        size = f"; a checkpoint takes {_size(self.directory / str(good[-1]))}" if good else ""
        return CheckpointError(
            f"saving checkpoint step {step} in {self.directory} failed: {error_reason(e)} ({free_space(self.directory)} free there{size}). "
            f"Training is stopped; the last good checkpoint ({f'step {good[-1]}' if good else 'none'}) is untouched. "
            "Free some space (or lower checkpoint.keep) and run the same command to resume."
        )

    def last_saved_step(self) -> int | None:
        """The latest step completely on disk, after the save in flight (if any) has finished."""
        self.wait()
        steps = finished_steps(self.directory.parent)
        return steps[-1] if steps else None

    def restore(self, step: int, abstract_state, data_iterator=None):
        """Restore ``step`` into arrays shaped and sharded like ``abstract_state``.

        Raises DamagedCheckpoint when its files changed since the save, cannot be read, or
        hold non-finite numbers; nothing is deleted."""
        self._check_files(step)
        renames = saved_renames(self.directory / str(step) / "state")
        target = rename_keys(abstract_state, {new: old for old, new in renames.items()})  # asked for by the saved names
        items = {"state": ocp.args.StandardRestore(target)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # Orbax raises many types, for damaged files and for mismatched trees alike
            raise self._unreadable(step, e) from None
        self._check_finite(step, restored["state"])
        return rename_keys(restored["state"], renames)

    def restore_params(self, step: int, abstract_params):
        """Only ``state["params"]`` of ``step`` (for evaluation and sampling: no optimizer moments,
        a third of the memory of a full restore), shaped and sharded like ``abstract_params``."""
        self._check_files(step)
        renames = saved_renames(self.directory / str(step) / "state")
        target = {"params": rename_keys(abstract_params, {new: old for old, new in renames.items()})}
        restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
            )
        except Exception as e:  # as in restore(): damaged files or another model
            raise self._unreadable(step, e) from None
        self._check_finite(step, restored["state"]["params"])
        return rename_keys(restored["state"]["params"], renames)

    def _check_files(self, step: int) -> None:
        if step not in self.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available steps: {self.all_steps()}")
        problem = checksum_problem(self.directory / str(step))
        if problem:
            raise self._damaged(step, problem)

    def _check_finite(self, step: int, tree) -> None:
        bad = non_finite_arrays(tree)
        if bad:
            raise self._damaged(step, f"{len(bad)} array(s) hold NaN or infinite values, e.g. {bad[0]}")

    def _unreadable(self, step: int, e: Exception) -> DamagedCheckpoint:
        return self._damaged(
            step,
            f"it could not be read ({error_reason(e)}); either its files are damaged or it holds another "
            f"model than {self.directory.parent / CONFIG_FILE} describes",
        )

    def _damaged(self, step: int, why: str) -> DamagedCheckpoint:
        others = [s for s in self.all_steps() if s != step]
        return DamagedCheckpoint(f"checkpoint step {step} in {self.directory} is damaged: {why}. Nothing was deleted; other steps: {others}.", step)

    def latest_intact_step(self, before: int) -> int | None:
        """The latest step before ``before`` whose files match their checksums (None if none)."""
        return next((s for s in sorted(self.all_steps(), reverse=True) if s < before and not checksum_problem(self.directory / str(s))), None)

    def set_aside_after(self, step: int) -> list[int]:
        """Move the steps after ``step`` to ``<workdir>/checkpoints.set_aside/`` (kept, not
        deleted), so that training continues from ``step`` and later saves never meet them.
        One process moves them; every process then calls ``reload``."""
        later = [s for s in self.all_steps() if s > step]
        if later:
            self.set_aside_directory.mkdir(exist_ok=True)
            for s in later:
                target = self.set_aside_directory / str(s)
                n = 1
                while target.exists():  # set aside twice: keep both
                    target, n = self.set_aside_directory / f"{s}.{n}", n + 1
                os.replace(self.directory / str(s), target)
        return later

    def reload(self) -> None:
        """Read the list of steps again (after ``set_aside_after`` on process 0)."""
        self.manager.reload()

    def close(self) -> None:
        """Wait for the save in flight and check it (raises CheckpointError if it failed)."""
        try:
            self.wait()
        finally:
            self.manager.close()
