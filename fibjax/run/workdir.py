"""A run directory's own records: the run's config (claimed, compared on resume, loaded), the
tokenizer it trained with, and where its data lives.

A run is one workdir: ``config.json`` holds its resolved TrainConfig, written when the run
starts and compared on every resume (only the fields in RESUMABLE_CHANGES may differ);
``tokenizer.sha256`` pins the tokenizer of its data, so data prepared again under the same path
is refused rather than read with other token ids; ``data.sha256.json`` records the token files
whose checksums the run verified (and when), so that a resume hashes only files changed since.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from fibjax import data as data_lib
from fibjax import distributed
from fibjax.config import TrainConfig, from_dict, to_dict
from fibjax.data.token_files import verify_checksums, write_json_atomically
from fibjax.errors import FibjaxError
from fibjax.run.integrity import CHECKPOINTS_DIR, MODEL_FILE, finished_steps, model_differences, saved_model
from fibjax.run.lock import LOCK_FILE

CONFIG_FILE = "config.json"
TOKENIZER_PIN = "tokenizer.sha256"
# written by fibjax.hf's import: the run holds imported weights and nothing to resume
IMPORTED_FILE = "hf_source.json"
DATA_RECORD = "data.sha256.json"
# the embedded corpus's directory inside a run that names no data.path
DATA_DIR = "data"
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


class CheckpointError(FibjaxError, RuntimeError):
    """A run directory or a checkpoint in it cannot be used; the message says why and what to do."""


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
    return [f"{k}: {a!r} (in {CONFIG_FILE}) vs {b!r} (this command)" for k, (a, b) in changed_fields(saved, current).items() if not allowed(k)]


def check_is_directory(workdir: Path) -> None:
    """``workdir`` is a directory or can become one: a file there (or above it) is named, not
    reported as "File exists" by the first mkdir."""
    for path in [Path(workdir), *Path(workdir).absolute().parents]:
        if path.exists():
            if not path.is_dir():
                raise CheckpointError(f"--workdir {workdir}: {path} is a file, not a directory; name another --workdir or move that file")
            return


def check_workdir(workdir: Path, cfg: TrainConfig) -> TrainConfig | None:
    """The run already in ``workdir`` (None for a new run); writes nothing.

    Raises CheckpointError when the workdir holds a different run or files of something else."""
    path = Path(workdir) / CONFIG_FILE
    if (Path(workdir) / IMPORTED_FILE).exists():
        raise CheckpointError(
            f"{workdir} holds a model imported from Hugging Face (weights only, no optimizer state); train from it in a new --workdir with init_from={workdir}"
        )
    if not path.exists():
        if Path(workdir).is_dir() and any(p.name != LOCK_FILE for p in Path(workdir).iterdir()):
            raise CheckpointError(f"workdir {workdir} is not empty and holds no fibjax run ({CONFIG_FILE} missing); use another --workdir")
        return None
    try:
        saved = from_dict(TrainConfig, json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path} is not a fibjax run config ({e}); use another --workdir") from None
    check_config_is_the_trained_one(Path(workdir), saved)
    diff = config_differences(saved, cfg)
    if diff:
        raise CheckpointError(
            f"workdir {workdir} holds a run with a different config; nothing was changed. Differences:\n  "
            + "\n  ".join(diff)
            + "\nUse a new --workdir, or the same config to resume."
        )
    return saved


def check_config_is_the_trained_one(workdir: Path, saved: TrainConfig) -> None:
    """``config.json`` still describes the model its latest checkpoint was saved with (the step's
    record, ``integrity.MODEL_FILE``; a step saved before the record is not compared here)."""
    steps = finished_steps(workdir)
    step_dir = Path(workdir) / CHECKPOINTS_DIR / str(steps[-1]) if steps else None
    record = saved_model(step_dir) if step_dir else None
    edited = model_differences(record, saved.model, f"in {CONFIG_FILE}") if record else []
    if edited:
        raise CheckpointError(
            f"{Path(workdir) / CONFIG_FILE} no longer describes the model its checkpoint step {steps[-1]} was saved with: "
            + "; ".join(edited)
            + f". Was it edited since the run saved it? Nothing was changed; put back the config the run was trained with (the step "
            f"records it: {step_dir / MODEL_FILE}), then resume with the command that trained it"
        )


def claim_workdir(workdir: Path, cfg: TrainConfig) -> TrainConfig | None:
    """Record ``cfg`` in a new workdir, or check it against the run already there and record
    it again (steps etc. may have changed). Returns the saved config (None for a new run)."""
    saved = check_workdir(workdir, cfg)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    write_json_atomically(Path(workdir) / CONFIG_FILE, to_dict(cfg))
    return saved


def load_run_config(workdir: Path) -> TrainConfig:
    """The run's config, from ``<workdir>/config.json``.

    Args:
        workdir: The run directory.

    Returns:
        The config.

    Raises:
        CheckpointError: ``workdir`` holds no ``config.json``.
    """
    path = Path(workdir) / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{workdir} holds no fibjax run ({CONFIG_FILE} missing)")
    return from_dict(TrainConfig, json.loads(path.read_text()))


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


_WARNED: set[str] = set()  # data directories warned about in this process (a start checks its data twice)
# token files up to this many bytes in all are hashed at every start (measured: 0.24-0.31 s for the
# CPU study's 28.6 MiB on 2 busy cores, ~110 MiB/s, so ~2.3 s here); larger data is hashed when a
# run first uses it, and then trusted by size and modification time, saying so once per start
HASH_EVERY_START_BYTES = 256 * 2**20


def verify_data(workdir: Path, data_dir: Path, meta: dict) -> dict:
    """The run's token files match their checksums (``verify_checksums``), and are the ones the
    run recorded (``DATA_RECORD``: another corpus prepared in their place is refused, naming a
    file). Data of up to HASH_EVERY_START_BYTES is hashed at every start; larger data only when
    a file's size or modification time changed since the run verified it. Warns once per run,
    when first used, about data prepared before meta.json carried checksums. Returns the record
    for ``record_data``; writes nothing."""
    path = Path(workdir) / DATA_RECORD
    before = json.loads(path.read_text()) if path.is_file() else {}
    files = [split["file"] for source in meta["sources"].values() for split in source.values() if isinstance(split, dict) and "file" in split]
    total = sum((Path(data_dir) / f).stat().st_size for f in files)
    trusted = before if total > HASH_EVERY_START_BYTES else {}
    record = verify_checksums(data_dir, meta, trusted)
    sha256 = meta.get("tokenizer", {}).get("sha256")
    if sha256:  # another tokenizer is the more telling error than the token files it changed
        check_tokenizer_pin(workdir, sha256)
    check_same_data(workdir, data_dir, before, record)
    if trusted and distributed.is_main() and f"trusted:{data_dir}" not in _WARNED:
        _WARNED.add(f"trusted:{data_dir}")
        print(
            f"note: the token files of {data_dir} ({total / 2**30:.1f} GiB, more than the {HASH_EVERY_START_BYTES >> 20} MiB hashed at every "
            f"start) are trusted by their size and modification time since the run verified them ({path}); delete that file to hash them again",
            file=sys.stderr,
        )
    unchecked = [f for f, entry in record.items() if entry["sha256"] is None and f not in before]
    if unchecked and distributed.is_main() and str(data_dir) not in _WARNED:
        _WARNED.add(str(data_dir))
        print(
            f"warning: {Path(data_dir) / 'meta.json'} records no checksums of its token files (prepared before fibjax wrote them): "
            "a token changed on disk to another valid id would go unnoticed. Running the command that prepared it again adds them.",
            file=sys.stderr,
        )
    return record


def check_same_data(workdir: Path, data_dir: Path, before: dict, now: dict) -> None:
    """The data is the data the run recorded: every file it recorded is there, with the sha256 it
    recorded (a file recorded without one, prepared before meta.json carried checksums, may gain one)."""
    for name, entry in sorted(before.items()):
        then = entry.get("sha256")
        if name not in now or (then is not None and now[name]["sha256"] != then):
            found = f"holds no token file {name}" if name not in now else f"has token file {name} with sha256 {str(now[name]['sha256'])[:12]}..."
            raise CheckpointError(
                f"{data_dir} is not the data the run in {workdir} trained on: it {found}, where the run recorded "
                f"{str(then)[:12]}... in {Path(workdir) / DATA_RECORD} (another corpus prepared in its place?). Point data.path at the "
                "data the run trained on, or train on this data in a new --workdir"
            )


def record_data(workdir: Path, record: dict) -> None:
    """Write what ``verify_data`` verified (the first start; a resume after a file's modification
    time changed or a file gained its checksum). ``check_same_data`` ran first: the sha256 a run
    recorded is never replaced by another."""
    path = Path(workdir) / DATA_RECORD
    if not path.is_file() or json.loads(path.read_text()) != record:
        write_json_atomically(path, record)


def data_dir_of(cfg: TrainConfig, workdir: Path) -> Path:
    """The run's prepared dataset: ``data.path``, or the embedded corpus in the workdir."""
    return Path(cfg.data.path) if cfg.data.path else Path(workdir) / DATA_DIR


def resolve_data_dir(cfg: TrainConfig, workdir: Path) -> Path:
    """``data_dir_of``, preparing the embedded corpus there on first use."""
    if not cfg.data.path:
        # one writer; the others wait for it (shared filesystem)
        distributed.on_main(lambda: data_lib.prepare_default(data_dir_of(cfg, workdir), cfg.data.default_vocab_size), "preparing the default corpus")
    return data_dir_of(cfg, workdir)
