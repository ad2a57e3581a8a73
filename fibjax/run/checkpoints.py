"""Checkpoints (the only module that imports Orbax): train state + data-iterator state.

Orbax writes each step into a temporary directory and renames it when complete, so a save
interrupted half-way never touches the previous checkpoint; keep-last-K deletes only older,
finished steps. Each step carries the sha256 of each of its files, written into the temporary
directory just before Orbax's rename (``_VerifiedRename``): no kill can leave a finished step
without them (``integrity.py`` reads them), with the model config it was saved from. Before a
restore the checksums are checked and the model record compared with the config in use; a
parameter tree is restored whole or not at all; restored arrays must be finite. A failed asynchronous save is reported by the next ``poll()``
(the loop polls every step), as one CheckpointError (``failures.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp

from fibjax import distributed
from fibjax.config import CheckpointConfig, ModelConfig
from fibjax.data.token_files import free_space, human_bytes, write_json_atomically
from fibjax.run import failures, integrity
from fibjax.run.integrity import (
    CHECKPOINTS_DIR,
    MODEL_FILE,
    SUMS_FILE,
    checksum_problem,
    model_differences,
    model_record,
    non_finite_arrays,
    numbered_steps,
    saved_model,
)
from fibjax.run.workdir import CONFIG_FILE, CheckpointError, load_run_config

# a save deletes the steps it retires first when the disk has less room than this x a checkpoint
ROOM_MARGIN = 1.25
# where --resume-step moves the steps after the one it resumes from (kept, not deleted)
SET_ASIDE_DIR = "checkpoints.set_aside"
# where a reader holds the step it reads (hard links, one directory per process; removed after)
HELD_DIR = "checkpoints.held"

# Keys renamed since a checkpoint may have been saved: saved name -> present name, wherever the
# key occurs in the state tree (the parameters and the optimizer's per-parameter moments alike).
# Restoring reads a checkpoint's own names and renames them, so earlier runs keep resuming.
RENAMED_KEYS = {"theta": "alpha_logit"}  # 2026-12-01: a learned layer's alpha parameter

# checkpoint directory -> the model record its steps are saved with (read by _VerifiedRename,
# which Orbax makes, in its thread, from the step's path alone)
_MODEL_RECORDS: dict[Path, dict] = {}
_UNRECORDED_WARNED: set[Path] = set()  # checkpoint directories warned about in this process


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


def _saved_tree(state_dir: Path):
    """The saved state tree's metadata (a nested dict), or None when it cannot be read."""
    try:  # the item's own metadata: a Checkpointer's metadata() looks for a step's _CHECKPOINT_METADATA
        return ocp.StandardCheckpointHandler().metadata(state_dir).tree  # in state/ and warns on every load
    except Exception:  # a damaged or foreign checkpoint: the restore itself reports it
        return None


def _paths(tree) -> set[str]:
    """Every leaf's path as 'a/b/c' (Orbax's metadata has string keys where the state has ints)."""
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def saved_renames(state_dir: Path) -> dict[str, str]:
    """The entries of RENAMED_KEYS whose old name the checkpoint at ``state_dir`` still uses
    (read from Orbax's metadata of the saved tree; {} when it cannot be read)."""
    tree = _saved_tree(state_dir)
    if tree is None:
        return {}
    keys = {getattr(k, "key", None) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0] for k in path}
    return {old: new for old, new in RENAMED_KEYS.items() if old in keys}


class DamagedCheckpoint(CheckpointError):
    """A step's files changed since they were saved, cannot be read, or hold non-finite numbers."""

    def __init__(self, message: str, step: int):
        """The error, with the damaged ``step`` kept as ``.step``.

        Args:
            message: What is wrong, naming the step's files.
            step: The damaged step.
        """
        super().__init__(message)
        self.step = step


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


class _VerifiedRename(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Orbax's commit by rename, with the step's checksums written into the temporary directory
    first: a step is never visible as finished without them (written after the commit, a kill in
    the 0.6-0.8 s between left a committed step that was restored unverified). Runs in Orbax's
    background thread, on the process that commits (process 0)."""

    async def finalize(self, *args, **kwargs):
        if self.get_final().name.isdigit():  # a step (Orbax commits its items, state/ and data/, the same way first)
            record = _MODEL_RECORDS.get(Path(self.get_final()).parent.resolve())
            if record is not None:
                await asyncio.to_thread(write_json_atomically, Path(self.get()) / MODEL_FILE, record)
            await asyncio.to_thread(integrity.record_checksums, Path(self.get()))
        await super().finalize(*args, **kwargs)


class Checkpointer:
    """Save / restore {state, data iterator} under ``<workdir>/checkpoints``."""

    def __init__(
        self, workdir: Path, cfg: CheckpointConfig, *, save_in_flight_bytes: int | None = None, model: ModelConfig | None = None, model_source: str = ""
    ):
        """``save_in_flight_bytes``: the most bytes of the state a save copies to the host at once
        (more than its largest array; default: Orbax's 96 GB). Bounded, a save of a model that
        already fills host memory (an import on the CPU backend, where the device is the host)
        adds that much instead of a second copy of the model.

        ``model``: the ModelConfig in use (``model_source`` says where it comes from, for the
        messages), recorded with every save and compared with a step's record before it is
        restored; default: the model of ``<workdir>/config.json`` (none if it has none).

        Args:
            workdir: The run directory.
            cfg: The checkpoint settings (``checkpoint.every_steps``, ``keep``, ...).
            save_in_flight_bytes: The most bytes a save copies to the host at once.
            model: The ModelConfig in use.
            model_source: Where ``model`` comes from, for messages.
        """
        self.directory = Path(workdir).resolve() / CHECKPOINTS_DIR
        self._origin = self  # whose steps the messages list (a held copy holds one step)
        if model is None and (Path(workdir) / CONFIG_FILE).is_file():
            with contextlib.suppress(Exception):  # not a run's config: nothing to record or compare
                model, model_source = load_run_config(Path(workdir)).model, f"in {Path(workdir) / CONFIG_FILE}"
        self._model, self._model_source = model, model_source or "in use"
        if model is not None:
            _MODEL_RECORDS[self.directory] = model_record(model)
        self.set_aside_directory = self.directory.parent / SET_ASIDE_DIR
        self.keep, self._cfg = cfg.keep, cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True, temporary_path_class=_VerifiedRename
        )
        handlers = None
        if save_in_flight_bytes is not None:
            handlers = {"state": ocp.StandardCheckpointHandler(save_concurrent_gb=save_in_flight_bytes / 1e9)}  # Orbax's GB are 1e9 bytes
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._unchecked: int | None = None  # the step of the last save, until its result is checked
        failures.quiet_orbax_failures()
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
        """The latest finished step (committed with its checksums), or None.

        Returns:
            The step, or None.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The finished steps: committed with their checksums.

        Returns:
            The steps, ascending.
        """
        return integrity.finished_steps(self.directory.parent)

    def unverified_steps(self) -> list[int]:
        """The steps committed without their checksums (a save interrupted after Orbax finished).

        Returns:
            The steps, ascending.
        """
        return integrity.unverified_steps(self.directory.parent)

    def save(self, step: int, state: dict, data_iterator: grain.DatasetIterator | None = None, *, wait: bool = False) -> None:  # noqa: DOC503
        """Save ``state`` (and the data iterator's position) as ``step``, asynchronously unless ``wait``;
        the previous save is waited for and checked first, and room is made for this one.

        Args:
            step: The step number.
            state: The train state (a pytree of arrays).
            data_iterator: The Grain iterator to checkpoint with it.
            wait: Wait for this save to finish and check it.

        Raises:
            CheckpointError: This save or the previous one failed.
        """
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
            steps = numbered_steps(self.directory)
            kept = set(steps[-max(self.keep - 1, 1) :]) | set(self.all_steps()[-1:])
            old = [s for s in steps if s not in kept]
            if not old:
                return []
            free, size = shutil.disk_usage(self.directory).free, _bytes(self.directory / str(steps[-1]))
            if free >= ROOM_MARGIN * size:  # the free space before deleting is the one the message reports
                return []
            for s in old:
                shutil.rmtree(self.directory / str(s))
            print(
                f"warning: {human_bytes(free)} free in {self.directory}, less than {ROOM_MARGIN:g} x a checkpoint ({ROOM_MARGIN:g} x "
                f"{human_bytes(size)} = {human_bytes(ROOM_MARGIN * size)}): deleted "
                f"checkpoint step(s) {old} before saving step {step} (checkpoint.keep={self.keep}); {free_space(self.directory)} free now",
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

    def wait(self) -> None:  # noqa: DOC503
        """Wait for the last save and check it, as ``poll``.

        Raises:
            CheckpointError: The save failed.
        """
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
        failed = f"saving checkpoint step {step} in {self.directory} failed: {failures.error_reason(e)}"
        kept = f"Training is stopped; the last good checkpoint ({f'step {good[-1]}' if good else 'none'}) is untouched."
        if not failures.disk_full(e):
            return CheckpointError(f"{failed}. {kept} Fix that and run the same command to resume.")
        size = f"; a checkpoint takes {human_bytes(_bytes(self.directory / str(good[-1])))}" if good else ""
        # keep = 1 or 2 already saves with one other step on disk: lowering it would not help
        keep = f" or lower checkpoint.keep (now {self.keep}; on a full disk a save first deletes all but keep - 1 steps)" if self.keep > 2 else ""
        return CheckpointError(f"{failed} ({free_space(self.directory)} free there{size}). {kept} Free some space{keep} and run the same command to resume.")

    def last_saved_step(self) -> int | None:
        """The latest step completely on disk, after the save in flight (if any) has finished.

        Returns:
            The step, or None.
        """
        self.wait()
        return self.latest_step()

    def restore(self, step: int, abstract_state: dict, data_iterator: grain.DatasetIterator | None = None) -> dict:  # noqa: DOC503
        """Restore ``step`` into arrays shaped and sharded like ``abstract_state``.

        Raises DamagedCheckpoint when its files changed since the save, cannot be read, or
        hold non-finite numbers; nothing is deleted.

        Args:
            step: The step to restore.
            abstract_state: The state's shapes and shardings (``Trainer.abstract_state``).
            data_iterator: A Grain iterator to restore the position of, in place.

        Returns:
            The state.

        Raises:
            DamagedCheckpoint: The step's files changed, cannot be read, or are not finite.
            CheckpointError: The step was saved with another model, or does not exist.
        """
        renames, target = self._checked_target(step, abstract_state, lambda saved: saved)
        items = {"state": ocp.args.StandardRestore(target)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # Orbax raises many types, for damaged files and for mismatched trees alike
            raise self._unreadable(step, e) from None
        self._check_finite(step, restored["state"])
        return rename_keys(restored["state"], renames)

    def restore_params(self, step: int, abstract_params: dict) -> dict:  # noqa: DOC503
        """Only ``state["params"]`` of ``step`` (for evaluation and sampling: no optimizer moments,
        a third of the memory of a full restore), shaped and sharded like ``abstract_params``.

        Args:
            step: The step to restore.
            abstract_params: The parameters' shapes and shardings.

        Returns:
            The parameters.

        Raises:
            DamagedCheckpoint: The step's files changed, cannot be read, or are not finite.
            CheckpointError: The step was saved with another model, or does not exist.
        """
        renames, target = self._checked_target(step, abstract_params, lambda saved: {"params": saved})
        restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
            )
        except Exception as e:  # as in restore(): damaged files or another model
            raise self._unreadable(step, e) from None
        self._check_finite(step, restored["state"]["params"])
        return rename_keys(restored["state"]["params"], renames)

    def _checked_target(self, step: int, abstract, wrap) -> tuple[dict, dict]:
        """Check ``step``'s files and model, then the tree to ask Orbax for: ``abstract`` under the
        names it was saved with, ``wrap``ped to the saved item's layout, checked to be whole.
        Returns (renames, target); ``rename_keys(restored, renames)`` maps the result back."""
        self.check_files(step)
        self.check_model(step)
        renames = saved_renames(self.directory / str(step) / "state")
        target = wrap(rename_keys(abstract, {new: old for old, new in renames.items()}))  # asked for by the saved names
        self._check_whole(step, target)
        return renames, target

    def check_files(self, step: int) -> None:  # noqa: DOC503
        """Raise DamagedCheckpoint unless ``step`` is finished and its files match their checksums.

        Args:
            step: The step.

        Raises:
            DamagedCheckpoint: The step is unfinished or its files do not match their checksums.
            CheckpointError: No checkpoint of that step.
        """
        if step in self.unverified_steps():
            raise self._damaged(step, checksum_problem(self.directory / str(step)))
        if step not in self.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available steps: {self._origin.all_steps()}")
        problem = checksum_problem(self.directory / str(step))
        if problem:
            raise self._damaged(step, problem)

    def check_model(self, step: int) -> None:
        """Raise CheckpointError when ``step`` was saved with another model than the one in use
        (its record, ``integrity.MODEL_FILE``). A step saved before steps recorded their model
        is restored with one warning: only its parameters' names and shapes are checked.

        Args:
            step: The step.

        Raises:
            CheckpointError: The step was saved with another model.
        """
        if self._model is None:
            return
        saved = saved_model(self.directory / str(step))
        if saved is None:
            if self._origin.directory not in _UNRECORDED_WARNED and jax.process_index() == 0:
                _UNRECORDED_WARNED.add(self._origin.directory)
                print(
                    f"warning: checkpoint step {step} in {self._origin.directory} records no model config (saved before fibjax recorded "
                    f"it): only its parameters' names and shapes are checked against the config {self._model_source}",
                    file=sys.stderr,
                )
            return
        diff = model_differences(saved, self._model, self._model_source)
        if diff:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} was saved with another model than the one {self._model_source}: "
                + "; ".join(diff)
                + f". Nothing was restored or deleted; put back the config the run was trained with (the step records it: "
                f"{self.directory / str(step) / MODEL_FILE}). To evaluate it under another attention or RoPE, keep that config "
                "and pass launch.eval --attention / --rope / --inference-mode; to train another model from it, use init_from in a new --workdir"
            )

    def _check_whole(self, step: int, target) -> None:
        """Refuse to restore part of a saved parameter tree: Orbax's partial restore reads the
        parameters ``target`` names and drops the rest, so a config edited to fewer layers
        evaluated the first of the trained blocks."""
        tree = _saved_tree(self.directory / str(step) / "state")
        if not isinstance(tree, dict) or "params" not in tree:
            return  # unreadable: the restore reports it
        extra = sorted(_paths({"params": tree["params"]}) - _paths(target))
        if extra:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} holds {len(extra)} parameter(s) the model {self._model_source} does not have, "
                f"e.g. {extra[0]}: it was saved from another model, and restoring part of it would evaluate some of its weights as "
                "another model. Nothing was restored or deleted; put back the config the run was trained with"
            )

    def _check_finite(self, step: int, tree) -> None:
        bad = non_finite_arrays(tree)
        if bad:
            raise self._damaged(step, f"{len(bad)} array(s) hold NaN or infinite values, e.g. {bad[0]}")

    def _unreadable(self, step: int, e: Exception) -> CheckpointError:
        # its files matched their checksums just before (check_files): they are the ones saved,
        # so what differs is the model asked for, i.e. the run's config
        config = self.directory.parent / CONFIG_FILE
        return CheckpointError(
            f"checkpoint step {step} in {self.directory} is intact (its files match their checksums) but does not fit the model "
            f"{config} describes ({failures.error_reason(e)}): was {config} edited since the run saved it? Nothing was deleted; "
            "put back the config the run was trained with, then resume with the command that trained it"
        )

    def _damaged(self, step: int, why: str) -> DamagedCheckpoint:
        others = [s for s in self._origin.all_steps() if s != step]
        return DamagedCheckpoint(f"checkpoint step {step} in {self.directory} is damaged: {why}. Nothing was deleted; other steps: {others}.", step)

    @contextlib.contextmanager
    def held(self, step: int) -> Iterator[Checkpointer]:  # noqa: DOC503
        """A Checkpointer that reads ``step`` from hard links to its files, so that a run training in
        the same workdir cannot take the step away while it is read (``checkpoint.keep`` deletes
        names; the bytes stay until their last link goes). Where links cannot be made (another
        filesystem, a read-only workdir, the step being deleted already) it is this one, and in
        a multi-process job too (a CheckpointManager there synchronises its processes over one
        directory, not one each). Its errors name the step where it is, not the links.

        Args:
            step: The step to read.

        Yields:
            The Checkpointer to read it with.

        Raises:
            DamagedCheckpoint: The step is damaged (named by its step).
            CheckpointError: Reading it failed otherwise.
        """
        root = self.directory.parent / HELD_DIR / f"{socket.gethostname()}-{os.getpid()}"
        if jax.process_count() > 1:
            yield self
            return
        try:
            shutil.copytree(self.directory / str(step), root / CHECKPOINTS_DIR / str(step), copy_function=os.link)
            holder = Checkpointer(root, self._cfg, model=self._model, model_source=self._model_source)
            holder._origin = self
        except (OSError, shutil.Error):
            shutil.rmtree(root, ignore_errors=True)
            yield self
            return
        shown = lambda e: str(e).replace(str(root / CHECKPOINTS_DIR), str(self.directory)).replace(str(root), str(self.directory.parent))  # noqa: E731
        try:
            yield holder
        except DamagedCheckpoint as e:
            raise DamagedCheckpoint(shown(e), e.step) from None
        except CheckpointError as e:
            raise CheckpointError(shown(e)) from None
        finally:
            holder.close()
            shutil.rmtree(root, ignore_errors=True)
            with contextlib.suppress(OSError):
                root.parent.rmdir()  # unless another reader holds a step too

    def latest_intact_step(self, before: int) -> int | None:
        """The latest finished step before ``before`` whose files match their checksums (None if none).

        Args:
            before: Only steps before this one.

        Returns:
            The step, or None.
        """
        return next((s for s in reversed(self.all_steps()) if s < before and not checksum_problem(self.directory / str(s))), None)

    def set_aside_after(self, step: int) -> list[int]:
        """Move the committed steps after ``step`` (finished or not) to
        ``<workdir>/checkpoints.set_aside/`` (kept, not deleted), so that training continues from
        ``step`` and later saves never meet them. One process moves them; every process then
        calls ``reload``.

        Args:
            step: The step training continues from.

        Returns:
            The steps moved.
        """
        later = [s for s in numbered_steps(self.directory) if s > step]
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
