"""Checkpoints (the only module that imports Orbax): train state + data-iterator state.

Orbax writes each step into a temporary directory and renames it when complete, so a save
interrupted half-way never touches the previous checkpoint; keep-last-K deletes only older,
finished steps. The run's resolved config sits beside the steps (``config.json``) and is
compared on every resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from fibjax.config import CheckpointConfig, TrainConfig, from_dict, to_dict
from fibjax.data.token_files import write_json_atomically

CONFIG_FILE = "config.json"
TOKENIZER_PIN = "tokenizer.sha256"
# Fields a resumed run may change: how long and how often, not what is trained.
RESUMABLE_CHANGES = ("steps", "log_every", "checkpoint", "eval", "mesh", "data.worker_count")


class CheckpointError(RuntimeError):
    """A checkpoint or workdir cannot be used; the message says why and what to do."""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def config_differences(saved: TrainConfig, current: TrainConfig) -> list[str]:
    """Fields that differ and may not change on resume, as 'field: saved -> current'."""
    a, b = _flatten(to_dict(saved)), _flatten(to_dict(current))
    allowed = lambda key: any(key == f or key.startswith(f + ".") for f in RESUMABLE_CHANGES)  # noqa: E731
    return [f"{k}: {a.get(k)!r} (saved) vs {b.get(k)!r} (now)" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not allowed(k)]


def claim_workdir(workdir: Path, cfg: TrainConfig) -> TrainConfig | None:
    """Record ``cfg`` in a new workdir, or check it against the run already there.

    Returns the saved config when resuming (None for a new run). Raises CheckpointError,
    writing nothing, when the workdir holds a different run.
    """
    path = Path(workdir) / CONFIG_FILE
    if path.exists():
        try:
            saved = from_dict(TrainConfig, json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path} is not a fibjax run config ({e}); use another --workdir") from None
        diff = config_differences(saved, cfg)
        if diff:
            raise CheckpointError(
                f"workdir {workdir} holds a run with a different config; nothing was changed. Differences:\n  "
                + "\n  ".join(diff) + "\nUse a new --workdir, or the same config to resume."
            )
        write_json_atomically(path, to_dict(cfg))  # steps etc. may have changed
        return saved
    Path(workdir).mkdir(parents=True, exist_ok=True)
    if any(Path(workdir).iterdir()):
        raise CheckpointError(f"workdir {workdir} is not empty and holds no fibjax run ({CONFIG_FILE} missing); use another --workdir")
    write_json_atomically(path, to_dict(cfg))
    return None


def pin_tokenizer(workdir: Path, sha256: str) -> None:
    """Record the tokenizer a run trains with, or check that the data still uses it.

    A data directory prepared again (other inputs, another vocabulary) keeps its path but not
    its token ids; training on or evaluating with it would give wrong numbers silently."""
    path = Path(workdir) / TOKENIZER_PIN
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(sha256 + "\n")
        os.replace(tmp, path)
        return
    pinned = path.read_text().strip()
    if pinned != sha256:
        raise CheckpointError(f"the run in {workdir} was trained with tokenizer sha256 {pinned[:12]}..., but its data directory now holds "
                              f"{sha256[:12]}... (prepared again?); the token ids would not match. Point data.path at the original data.")


def pinned_tokenizer(workdir: Path) -> str | None:
    """The tokenizer sha256 a run trained with (None for a run that never started training)."""
    path = Path(workdir) / TOKENIZER_PIN
    return path.read_text().strip() if path.exists() else None


def load_run_config(workdir: Path) -> TrainConfig:
    path = Path(workdir) / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{workdir} holds no fibjax run ({CONFIG_FILE} missing)")
    return from_dict(TrainConfig, json.loads(path.read_text()))


class Checkpointer:
    """Save / restore {state, data iterator} under ``<workdir>/checkpoints``."""

    def __init__(self, workdir: Path, cfg: CheckpointConfig):
        self.directory = Path(workdir).resolve() / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_iterator=None, *, wait: bool = False) -> None:
        items = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        if wait:
            self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state, data_iterator=None):
        """Restore ``step`` into arrays shaped and sharded like ``abstract_state``."""
        if step not in self.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available steps: {self.all_steps()}")
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # Orbax raises many types, for damaged files and for mismatched trees alike
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} could not be read ({type(e).__name__}: {e}). Either its files are "
                f"damaged, or it holds another model than {self.directory.parent / CONFIG_FILE} describes (shapes or "
                f"parameter names differ: compare the error above). Other steps: {[s for s in self.all_steps() if s != step]}. "
                f"Nothing was deleted."
            ) from e
        return restored["state"]

    def restore_params(self, step: int, abstract_params):
        """Only ``state["params"]`` of ``step`` (for evaluation and sampling: no optimizer moments,
        a third of the memory of a full restore), shaped and sharded like ``abstract_params``."""
        if step not in self.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available steps: {self.all_steps()}")
        target = {"params": abstract_params}
        restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
            )
        except Exception as e:  # as in restore(): damaged files or another model
            raise CheckpointError(
                f"the parameters of checkpoint step {step} in {self.directory} could not be read ({type(e).__name__}: {e}). Either its "
                f"files are damaged, or it holds another model than {self.directory.parent / CONFIG_FILE} describes. Nothing was deleted."
            ) from e
        return restored["state"]["params"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
