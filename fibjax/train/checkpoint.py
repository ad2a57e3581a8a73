"""Checkpoints (the only module that imports Orbax): train state + data-iterator state.

Orbax writes each step into a temporary directory and renames it when complete, so a save
interrupted half-way never touches the previous checkpoint; keep-last-K deletes only older,
finished steps. Orbax does not notice changed bytes (its zstd frames carry no checksum), so
each step carries the sha256 of each of its files (``<step>/fibjax.sha256.json``), written
into the temporary directory just before Orbax's rename (``_VerifiedRename``): no kill can
leave a finished step without them. A step without them (saved before checksums existed, or
by another writer) counts as unfinished: it is never restored. Checksums are checked before a
restore, and restored arrays must be finite. A failed asynchronous save is reported by the
next ``poll()`` (the loop polls every step), as one CheckpointError. The run's resolved config
sits beside the steps (``config.json``) and is compared on every resume.
"""

from __future__ import annotations

import asyncio
import errno
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

from fibjax import distributed
from fibjax.config import CheckpointConfig, TrainConfig, from_dict, to_dict
from fibjax.data.token_files import file_sha256, free_space, human_bytes, write_json_atomically
from fibjax.errors import FibjaxError
from fibjax.train.lock import LOCK_FILE

CONFIG_FILE = "config.json"
TOKENIZER_PIN = "tokenizer.sha256"
SUMS_FILE = "fibjax.sha256.json"
# a save deletes the steps it retires first when the disk has less room than this x a checkpoint
ROOM_MARGIN = 1.25
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
    try:  # the item's own metadata: a Checkpointer's metadata() looks for a step's _CHECKPOINT_METADATA
        tree = ocp.StandardCheckpointHandler().metadata(state_dir).tree  # in state/ and warns on every load
    except Exception:  # a damaged or foreign checkpoint: the restore itself reports it
        return {}
    keys = {getattr(k, "key", None) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0] for k in path}
    return {old: new for old, new in RENAMED_KEYS.items() if old in keys}


class CheckpointError(FibjaxError, RuntimeError):
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
        if Path(workdir).is_dir() and any(p.name != LOCK_FILE for p in Path(workdir).iterdir()):
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


def _numbered_steps(directory: Path) -> list[int]:
    # Orbax names a step's directory by its number only once the step is committed
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) if directory.is_dir() else []


def finished_steps(workdir: Path) -> list[int]:
    """Steps with a complete, verifiable checkpoint in ``workdir`` (committed with their
    checksums), read without creating anything."""
    directory = Path(workdir) / "checkpoints"
    return [s for s in _numbered_steps(directory) if (directory / str(s) / SUMS_FILE).is_file()]


def unverified_steps(workdir: Path) -> list[int]:
    """Committed steps without checksums: saved before checksums existed, by another writer, or
    (before they were written inside the commit) killed between Orbax's commit and the checksums.
    Never restored: nothing proves their bytes are the ones saved."""
    directory = Path(workdir) / "checkpoints"
    return [s for s in _numbered_steps(directory) if not (directory / str(s) / SUMS_FILE).is_file()]


class DamagedCheckpoint(CheckpointError):
    """A step's files changed since they were saved, cannot be read, or hold non-finite numbers."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


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


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def record_checksums(step_dir: Path) -> None:
    """Write the sha256 of every file of a step's items into the step (about 1.4 GB/s). Orbax's
    own files at the step's top (its step metadata, its commit marker) are left out: Orbax
    rewrites them during the commit, after these sums are written."""
    files = [f for f in sorted(step_dir.rglob("*")) if f.is_file() and len(f.relative_to(step_dir).parts) > 1]
    write_json_atomically(step_dir / SUMS_FILE, {str(f.relative_to(step_dir)): file_sha256(f) for f in files})


class _VerifiedRename(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Orbax's commit by rename, with the step's checksums written into the temporary directory
    first: a step is never visible as finished without them (written after the commit, a kill in
    the 0.6-0.8 s between left a committed step that was restored unverified). Runs in Orbax's
    background thread, on the process that commits (process 0)."""

    async def finalize(self, *args, **kwargs):
        if self.get_final().name.isdigit():  # a step (Orbax commits its items, state/ and data/, the same way first)
            await asyncio.to_thread(record_checksums, Path(self.get()))
        await super().finalize(*args, **kwargs)


def checksum_problem(step_dir: Path) -> str | None:
    """What is wrong with a step's files (None: they are the ones saved)."""
    path = step_dir / SUMS_FILE
    if not path.is_file():
        return f"it has no checksums ({SUMS_FILE}): its save did not finish, or it was written before checksums existed"
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
        self.keep = cfg.keep
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True, temporary_path_class=_VerifiedRename
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._unchecked: int | None = None  # the step of the last save, until its result is checked
        _quiet_orbax_failures()
        finished, unverified = self.all_steps(), self.unverified_steps()
        newer = [s for s in unverified if not finished or s > finished[-1]]
        if newer and jax.process_index() == 0:
            print(
                f"warning: checkpoint step(s) {newer} in {self.directory} have no checksums ({SUMS_FILE}): their save did not "
                f"finish, or they were written before checksums existed; they are not used (latest finished step: "
                f"{finished[-1] if finished else 'none'})",
                file=sys.stderr,
            )

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The finished steps: committed with their checksums."""
        return finished_steps(self.directory.parent)

    def unverified_steps(self) -> list[int]:
        return unverified_steps(self.directory.parent)

    def save(self, step: int, state, data_iterator=None, *, wait: bool = False) -> None:
        self.wait()  # the previous save first, so that its failure is reported as its own
        self._make_room(step)
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

    def _make_room(self, step: int) -> None:
        """Orbax deletes the steps beyond ``keep`` only once a save has finished, so a save needs
        room for keep + 1 checkpoints. When the disk has less room than the newest checkpoint
        takes (x ROOM_MARGIN), the steps this save would retire anyway (all but the newest
        keep - 1, never the newest) are deleted first: lowering checkpoint.keep then frees the
        room a save needs. One process deletes; every process reads the steps again."""

        def retire() -> list[int]:
            steps = _numbered_steps(self.directory)
            kept = set(steps[-max(self.keep - 1, 1) :]) | set(self.all_steps()[-1:])
            old = [s for s in steps if s not in kept]
            if not old or shutil.disk_usage(self.directory).free >= ROOM_MARGIN * _bytes(self.directory / str(steps[-1])):
                return []
            for s in old:
                shutil.rmtree(self.directory / str(s))
            print(
                f"warning: {free_space(self.directory)} free in {self.directory}, less than a checkpoint takes: deleted "
                f"checkpoint step(s) {old} before saving step {step} (checkpoint.keep={self.keep})",
                file=sys.stderr,
            )
            return old

        retired = distributed.on_main(retire, f"making room for checkpoint step {step}")
        if retired or jax.process_count() > 1:  # the others cannot know whether process 0 deleted
            self.manager.reload()

    def poll(self) -> None:
        """Check the last save as soon as it has finished in the background: raise CheckpointError
        if it failed. While a save runs this reads a flag under a lock (measured: 5 us a call;
        0.05 us with no save pending): cheap every step."""
        if self._unchecked is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Wait for the last save and check it, as ``poll``."""
        step, self._unchecked = self._unchecked, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(step, e) from None

    def _save_failed(self, step: int | None, e: Exception) -> CheckpointError:
        # the failed step's half-written directory is useless (Orbax ignores it) and holds the
        # space the metrics and events still need to be flushed
        if jax.process_index() == 0:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        good = [s for s in self.all_steps() if s != step]
        failed = f"saving checkpoint step {step} in {self.directory} failed: {error_reason(e)}"
        kept = f"Training is stopped; the last good checkpoint ({f'step {good[-1]}' if good else 'none'}) is untouched."
        if not disk_full(e):
            return CheckpointError(f"{failed}. {kept} Fix that and run the same command to resume.")
        size = f"; a checkpoint takes {human_bytes(_bytes(self.directory / str(good[-1])))}" if good else ""
        # keep = 1 or 2 already saves with one other step on disk: lowering it would not help
        keep = f" or lower checkpoint.keep (now {self.keep}; on a full disk a save first deletes all but keep - 1 steps)" if self.keep > 2 else ""
        return CheckpointError(f"{failed} ({free_space(self.directory)} free there{size}). {kept} Free some space{keep} and run the same command to resume.")

    def last_saved_step(self) -> int | None:
        """The latest step completely on disk, after the save in flight (if any) has finished."""
        self.wait()
        return self.latest_step()

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
        if step in self.unverified_steps():
            raise self._damaged(step, checksum_problem(self.directory / str(step)))
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
        """The latest finished step before ``before`` whose files match their checksums (None if none)."""
        return next((s for s in reversed(self.all_steps()) if s < before and not checksum_problem(self.directory / str(s))), None)

    def set_aside_after(self, step: int) -> list[int]:
        """Move the committed steps after ``step`` (finished or not) to
        ``<workdir>/checkpoints.set_aside/`` (kept, not deleted), so that training continues from
        ``step`` and later saves never meet them. One process moves them; every process then
        calls ``reload``."""
        later = [s for s in _numbered_steps(self.directory) if s > step]
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
