"""Which checkpoint steps are finished, and whether their files are still the ones saved.

Orbax does not notice changed bytes (its zstd frames carry no checksum), so each step carries
the sha256 of each of its files (``<step>/fibjax.sha256.json``), written inside Orbax's commit
(``checkpoints._VerifiedRename``). A step without them (saved before checksums existed, or by
another writer) counts as unfinished: it is never restored. Restored arrays must be finite too.

Each step also records the model config it was saved with (``<step>/fibjax.model.json``, one of
the files its checksums cover): a restore compares it with the config in use, so a config.json
edited to another model (fewer layers, other heads of the same shapes, another window) is
refused by name instead of restoring some of the weights or reading them as another model.
"""

from __future__ import annotations

import json
from pathlib import Path

from fibjax.config import to_dict
from fibjax.data.token_files import file_sha256, write_json_atomically

SUMS_FILE = "fibjax.sha256.json"
CHECKPOINTS_DIR = "checkpoints"
MODEL_FILE = "fibjax.model.json"
# model fields that do not change what is trained (workdir.RESUMABLE_CHANGES): not recorded
UNRECORDED = ("remat", "scan_layers", "logits_chunk")


def numbered_steps(directory: Path) -> list[int]:
    """The committed steps in a checkpoint directory, finished or not."""
    # Orbax names a step's directory by its number only once the step is committed
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) if directory.is_dir() else []


def finished_steps(workdir: Path) -> list[int]:
    """Steps with a complete, verifiable checkpoint in ``workdir`` (committed with their
    checksums), read without creating anything."""
    directory = Path(workdir) / CHECKPOINTS_DIR
    return [s for s in numbered_steps(directory) if (directory / str(s) / SUMS_FILE).is_file()]


def unverified_steps(workdir: Path) -> list[int]:
    """Committed steps without checksums: saved before checksums existed, by another writer, or
    (before they were written inside the commit) killed between Orbax's commit and the checksums.
    Never restored: nothing proves their bytes are the ones saved."""
    directory = Path(workdir) / CHECKPOINTS_DIR
    return [s for s in numbered_steps(directory) if not (directory / str(s) / SUMS_FILE).is_file()]


def unfinished_saves(workdir: Path) -> list[int]:
    """Steps whose save began but never committed: Orbax's temporary ``<step>.orbax-checkpoint-tmp*``
    directories, which a kill mid-save leaves (Orbax ignores them; a later save of the step
    replaces them)."""
    directory = Path(workdir) / CHECKPOINTS_DIR
    names = (p.name.split(".")[0] for p in directory.glob("*.orbax-checkpoint-tmp*")) if directory.is_dir() else ()
    return sorted({int(n) for n in names if n.isdigit()})


def model_record(model) -> dict:
    """What a step records of the model config ``model`` (a ModelConfig): its flattened fields,
    as JSON has them, less UNRECORDED."""
    flat = _flatten(json.loads(json.dumps(to_dict(model))))
    return {k: v for k, v in flat.items() if k.split(".")[0] not in UNRECORDED}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def saved_model(step_dir: Path) -> dict | None:
    """The model record of a step (None: saved before steps recorded their model)."""
    path = step_dir / MODEL_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def model_differences(saved: dict, model, in_use: str) -> list[str]:
    """The fields where ``model`` differs from a step's record ``saved``, as
    'model.FIELD: SAVED (saved with the checkpoint) vs NOW (IN_USE)'. A field that only one side
    has (added to fibjax or removed since the save) is not compared."""
    now = model_record(model)
    return [f"model.{k}: {saved[k]!r} (saved with the checkpoint) vs {now[k]!r} ({in_use})" for k in sorted(saved) if k in now and saved[k] != now[k]]


def record_checksums(step_dir: Path) -> None:
    """Write the sha256 of every file of a step's items, and of its model record, into the step
    (about 1.4 GB/s). Orbax's own files at the step's top (its step metadata, its commit marker)
    are left out: Orbax rewrites them during the commit, after these sums are written."""
    files = [f for f in sorted(step_dir.rglob("*")) if f.is_file() and (len(f.relative_to(step_dir).parts) > 1 or f.name == MODEL_FILE)]
    write_json_atomically(step_dir / SUMS_FILE, {str(f.relative_to(step_dir)): file_sha256(f) for f in files})


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
    import jax  # here: the rest of this module is read by commands that never start JAX
    import jax.numpy as jnp

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(path) for path, x in leaves if jnp.issubdtype(x.dtype, jnp.inexact) and not bool(jnp.isfinite(x).all())]
