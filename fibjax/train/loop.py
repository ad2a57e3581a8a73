"""The training loop: data, sharded state, resume, metrics, checkpoints, preemption.

``train(cfg, workdir)`` is the whole run; ``launch.train`` only parses arguments. Metrics of
step N are read after step N+1 is dispatched (no host stall per step); a checkpoint is written
only after the metrics of the update that produced it were checked finite, so a NaN never
reaches disk, and a failed background save is noticed at the next step, not the next save.

Every check that can refuse a run (workdir, steps, data, vocabulary, mesh) runs before the
workdir is claimed: a refused start writes nothing, so the corrected command is not then
refused as "a different config". A resume records its config only once its checkpoint is
restored: a failed resume changes nothing on disk either.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from fibjax import data as data_lib
from fibjax import distributed, sharding
from fibjax.config import ConfigError, TrainConfig, parse_weights
from fibjax.data import DataError
from fibjax.data.token_files import META_FILE, check_token_ids, free_space, open_tokens
from fibjax.errors import FibjaxError, pip_install
from fibjax.run.checkpoints import Checkpointer, DamagedCheckpoint
from fibjax.run.curves import curve_key, curve_values
from fibjax.run.failures import disk_full
from fibjax.run.integrity import finished_steps, unfinished_saves
from fibjax.run.lock import WorkdirLock
from fibjax.run.workdir import (
    CheckpointError,
    check_is_directory,
    check_tokenizer_pin,
    check_workdir,
    claim_workdir,
    data_dir_of,
    pin_tokenizer,
    record_data,
    resolve_data_dir,
    verify_data,
)
from fibjax.train import init_from
from fibjax.train.metrics import MetricsWriter, fit_summary, read_metrics
from fibjax.train.optimizer import lr_schedule
from fibjax.train.step import build
from fibjax.train.stopping import Preemption, unless_stopped

# Test-only fault injection: SIGKILL this process right after the checkpoint of this step is
# on disk, to test exact resume after a crash deterministically.
_FAULT_ENV = "FIBJAX_FAULT_AFTER_SAVE"
# Test-only: append each step's row hashes to <dir>/batches.<process>.jsonl, to check that the
# processes feed different rows that together make the 1-process batch.
_BATCH_LOG_ENV = "FIBJAX_LOG_BATCHES"


class NonFiniteLoss(FibjaxError, RuntimeError):
    """The training loss became NaN or infinite (the message names the step); the run stops there."""

    pass


@dataclass
class RunResult:
    """What [train][fibjax.train.train] did: the last step reached, whether it was stopped by a signal, the
    data used, and the losses it logged.
    """

    final_step: int
    preempted: bool
    data_dir: Path
    losses: list[float] = field(default_factory=list)
    already_done: bool = False  # the run had reached cfg.steps before: nothing was trained
    left_compiling: bool = False  # stopped while compiling: the compiler still runs in a thread; exit without waiting


def check_data(cfg: TrainConfig, data_dir: Path, workdir: Path) -> tuple[str, dict]:
    """The data is intact (sizes, checksums, token ids < vocabulary), fits the model, and has the
    tokenizer the run started with; returns that tokenizer's sha256 and the record of the
    verified files (``record_data``). Reads only."""
    try:
        meta = data_lib.load_meta(data_dir)
        vocab = meta["tokenizer"]["vocab_size"]
        for source in meta["sources"].values():
            for split in source.values():
                check_token_ids(data_dir / split["file"], np.dtype(meta["dtype"]), vocab)
        verified = verify_data(workdir, data_dir, meta)  # after the ids: an id out of range is the more telling error
    except DataError as e:
        if cfg.data.path and _prepares(cfg.data.prepare, cfg.data.path) and not (data_dir / META_FILE).exists():
            raise DataError(
                f"data directory {str(data_dir)!r} {'holds no prepared data' if data_dir.exists() else 'does not exist'}; this config's data "
                f"is prepared (online: Hugging Face datasets, {pip_install('hf')}) by: {cfg.data.prepare}"
            ) from None
        if cfg.data.path:
            raise
        raise DataError(f"{e} ({data_dir} is the run's copy of the embedded corpus: delete it and run the same command again)") from None
    check_tokenizer_pin(workdir, meta["tokenizer"]["sha256"])
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({vocab}) in {data_dir}")
    return meta["tokenizer"]["sha256"], verified


def _prepares(command: str, path: str) -> bool:
    """``command`` (a config's ``data.prepare``) writes ``path``: with ``data.path`` overridden to
    other data, the config's own command would prepare the wrong directory."""
    words = shlex.split(command)
    return "--out" in words[:-1] and Path(words[words.index("--out") + 1]) == Path(path)


def start_step(cfg: TrainConfig, workdir: Path, resume_step: int | None) -> int:
    """The step to train from: ``resume_step``, else the latest checkpoint (0 for a new run).
    ``steps`` below it is refused: it would not shorten the run, only call it finished."""
    saved = finished_steps(workdir)
    if resume_step is not None and resume_step not in saved:
        raise CheckpointError(f"--resume-step {resume_step}: {workdir} has no checkpoint of that step; its steps: {saved}")
    start = resume_step if resume_step is not None else (saved[-1] if saved else 0)
    if start > cfg.steps:
        raise ConfigError(
            f"steps: {cfg.steps} is below step {start}, which the run in {workdir} has already reached; "
            f"pass steps={start} or more to continue it, or use a new --workdir"
        )
    return start


def warn_schedule_change(saved: TrainConfig, cfg: TrainConfig, start: int) -> None:
    """Changing ``steps`` on resume is allowed (to extend a run), but the warm-up + cosine
    schedule is a function of ``steps``: say so, with the learning rate before and after."""
    old, new = float(lr_schedule(saved.optim, saved.steps)(start)), float(lr_schedule(cfg.optim, cfg.steps)(start))
    print(
        f"warning: steps changed from {saved.steps} to {cfg.steps}: the learning-rate schedule (cosine decay to the last step) "
        f"changes from step {start} on (lr {old:.3g} in the old schedule, {new:.3g} in the new)",
        file=sys.stderr,
    )


def preflight(cfg: TrainConfig, workdir: Path, resume_step: int | None) -> tuple[int, jax.sharding.Mesh | None, init_from.Source | None]:
    """Every check that can refuse the run, writing nothing. Returns the start step, the device
    mesh (None when the run is already complete: nothing to build) and, for a new run with
    ``init_from``, the checked source run."""
    saved = distributed.on_main(lambda: check_workdir(workdir, cfg), f"claiming the workdir {workdir}")
    start = start_step(cfg, workdir, resume_step)
    if start == cfg.steps:
        distributed.on_main(lambda: check_final_step(cfg, workdir, start), f"checking checkpoint step {start}")
        return start, None, None
    if saved is not None and start and saved.steps != cfg.steps:
        warn_schedule_change(saved, cfg, start)
    if cfg.global_batch % jax.process_count():
        raise ConfigError(f"global_batch: {cfg.global_batch} is not divisible by the {jax.process_count()} processes")
    mesh = sharding.make_mesh(cfg.mesh)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.global_batch % batch_shards:
        raise ConfigError(f"global_batch: {cfg.global_batch} is not divisible by data x fsdp = {batch_shards}")
    source = init_from.locate(cfg) if cfg.init_from and not start else None
    if cfg.data.path:
        sha, _ = check_data(cfg, Path(cfg.data.path), workdir)
        if source:
            init_from.check_tokenizer(source, sha)
    elif cfg.data.default_vocab_size > cfg.model.vocab_size:  # the embedded corpus is prepared after the claim
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} is smaller than the embedded corpus's vocabulary "
            f"(data.default_vocab_size = {cfg.data.default_vocab_size})"
        )
    return start, mesh, source


def validation_batches(cfg: TrainConfig, data_dir: Path, batch_shards: int) -> dict[str, np.ndarray]:
    """Per validation-curve key (``curve_key``), this process's rows of fixed batches
    [N, rows, m*T+1]: the source's first ``eval.curve_tokens`` tokens (``curve_long_tokens``
    beyond 1x) cut into windows of m*seq_len + 1. At 1x a batch has the training batch's rows;
    longer windows go in batches of fewer rows (a multiple of the ``batch_shards`` the batch is
    split over). A source too short for one batch is left out of that length."""
    if not cfg.eval.every_steps:
        return {}
    meta = data_lib.load_meta(data_dir)
    out = {}
    for name in data_lib.validation_sources(meta):
        stream = open_tokens(data_dir, meta, name, "val")
        for m in cfg.eval.curve_multipliers:
            t = m * cfg.seq_len + 1
            tokens = cfg.eval.curve_tokens if m == 1 else cfg.eval.curve_long_tokens
            windows = min(tokens // (m * cfg.seq_len), len(stream) // t)
            rows = cfg.global_batch if m == 1 else max(batch_shards, min(windows, cfg.global_batch) // batch_shards * batch_shards)
            if n := windows // rows:
                batches = np.asarray(stream[: n * rows * t], dtype=np.int32).reshape(n, rows, t)
                per_process = rows // jax.process_count()
                out[curve_key(m, name)] = batches[:, jax.process_index() * per_process : (jax.process_index() + 1) * per_process]
    return out


def _batch_log():
    if not os.environ.get(_BATCH_LOG_ENV):
        return None
    return (Path(os.environ[_BATCH_LOG_ENV]) / f"batches.{jax.process_index()}.jsonl").open("a", buffering=1)


def restore(ckpt: Checkpointer, step: int, trainer, data_iter, resume_step: int | None):
    """The state of checkpoint ``step``. A damaged step is an error that names the way on: the
    latest intact earlier step, to pass as ``--resume-step``. Once it is restored, the committed
    steps after it (those after ``resume_step``, or unfinished ones: without checksums) are set
    aside (moved, not deleted), so that the run continues from it."""
    try:
        state = ckpt.restore(step, trainer.abstract_state, data_iter)
    except DamagedCheckpoint as e:
        raise CheckpointError(f"{e} {way_on(ckpt, e.step)}") from None
    moved = distributed.on_main(lambda: ckpt.set_aside_after(step), "setting aside the later checkpoints")
    ckpt.reload()
    if moved:
        print(
            f"warning: resuming from step {step}: checkpoint step(s) {moved} moved to {ckpt.set_aside_directory} (delete them when no longer needed)",
            file=sys.stderr,
        )
    return state


def way_on(ckpt: Checkpointer, damaged: int) -> str:
    """What to do about a damaged step: continue from the latest intact one before it."""
    earlier = ckpt.latest_intact_step(before=damaged)
    if not earlier:
        return "No earlier checkpoint is intact: train again in a new --workdir."
    return (
        f"To continue from step {earlier}, run the same command with --resume-step {earlier} "
        f"(the later steps are then moved to {ckpt.set_aside_directory}, not deleted)."
    )


def check_final_step(cfg: TrainConfig, workdir: Path, step: int) -> None:
    """A complete run's last checkpoint is intact (what ``launch.eval`` will read), checked before
    "nothing to do" is said."""
    ckpt = Checkpointer(workdir, cfg.checkpoint, model=cfg.model, model_source="in this command's config")
    try:
        ckpt.check_files(step)
        ckpt.check_model(step)
    except DamagedCheckpoint as e:
        raise CheckpointError(f"{workdir} is complete, but {e} {way_on(ckpt, e.step)}") from None
    finally:
        ckpt.close()


def _write_failed(e: OSError, ckpt: Checkpointer) -> CheckpointError:
    """One error for a failed write of the metrics or events. A save in flight on the same
    full disk has failed too, as a rule: waiting for it reports that failure instead."""
    saved = ckpt.last_saved_step()
    where = e.filename or ckpt.directory.parent
    free = f" ({free_space(where)} free there)" if disk_full(e) else ""
    return CheckpointError(
        f"could not write {where}: {e.strerror or e}{free}. "
        f"Training is stopped; {f'the last good checkpoint (step {saved}) is untouched' if saved else 'no checkpoint was saved yet'}. "
        f"{'Free some space' if disk_full(e) else 'Fix that'} and run the same command to resume."
    )


def _close_all(closers, *, failing: bool) -> None:
    """Call every closer. While an error is on its way out, an error from closing (the same full
    disk, the same failed save) must not replace it; otherwise the first one is raised."""
    first = None
    for close in closers:
        try:
            close()
        except Exception as e:
            first = first or e
    if first is not None and not failing:
        raise first


def train(cfg: TrainConfig, workdir: str | Path, *, progress: bool = True, resume_step: int | None = None, preemption: Preemption | None = None) -> RunResult:  # noqa: DOC502
    """Train ``cfg`` in ``workdir``, from its latest checkpoint (or ``resume_step``) to ``cfg.steps``.

    One run per workdir: process 0 holds its lock (fibjax/run/lock.py) from before the first
    check to the end, so a second start is refused at once, naming the holder. ``preemption``:
    a handler its caller installed already (``launch.train``, before its imports); default:
    one installed for the call.

    Args:
        cfg: The config.
        workdir: The run directory.
        progress: Show a progress bar.
        resume_step: The checkpoint to continue from (default: the latest).
        preemption: A stop handler already installed.

    Returns:
        What was done.

    Raises:
        ConfigError: A config the data or the devices do not fit.
        DataError: Missing or damaged data.
        WorkdirInUse: Another run holds the workdir.
        CheckpointError: A checkpoint cannot be saved or restored.
        NonFiniteLoss: The loss became NaN or infinite.
    """
    distributed.initialize()
    workdir = Path(workdir)
    check_is_directory(workdir)
    lock = WorkdirLock(workdir)
    distributed.on_main(lock.acquire, f"locking the workdir {workdir}")
    try:
        with contextlib.nullcontext(preemption) if preemption else Preemption() as stop:  # a signal while restoring or compiling stops the run too
            return _train(cfg, workdir, progress, resume_step, stop)
    finally:
        lock.release()  # a no-op on the processes that do not hold it


def _train(cfg: TrainConfig, workdir: Path, progress: bool, resume_step: int | None, preemption: Preemption) -> RunResult:
    start, mesh, source = preflight(cfg, workdir, resume_step)
    if mesh is None:
        return RunResult(final_step=start, preempted=False, data_dir=data_dir_of(cfg, workdir), already_done=True)
    if not start:  # a new run: claimed before the embedded corpus is prepared in it (one writer of config.json)
        distributed.on_main(lambda: claim_workdir(workdir, cfg), f"claiming the workdir {workdir}")
    data_dir = resolve_data_dir(cfg, workdir)
    tokenizer_sha256, verified = check_data(cfg, data_dir, workdir)  # again for the embedded corpus, prepared just now
    if source:
        init_from.check_tokenizer(source, tokenizer_sha256)
    if not start:
        distributed.on_main(lambda: (pin_tokenizer(workdir, tokenizer_sha256), record_data(workdir, verified)), "recording the run's data")

    trainer = build(cfg, mesh)
    data_iter = data_lib.train_iterator(
        data_dir,
        parse_weights(cfg.data.weights),
        seq_len=cfg.seq_len,
        global_batch=cfg.global_batch,
        seed=cfg.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        worker_count=cfg.data.worker_count,
    )
    ckpt = Checkpointer(workdir, cfg.checkpoint, model=cfg.model, model_source="in this command's config")
    state = restore(ckpt, start, trainer, data_iter, resume_step) if start else trainer.init()
    if start:  # a resume writes nothing before its checkpoint is restored: a failed one changes nothing
        distributed.on_main(
            lambda: (claim_workdir(workdir, cfg), pin_tokenizer(workdir, tokenizer_sha256), record_data(workdir, verified)),
            f"recording the resumed run in {workdir}",
        )
    if source:
        state, notes = init_from.initial_state(state, source, mesh)
        if distributed.is_main():
            print(
                f"initialised from {source.workdir} step {source.step} (parameters only: a fresh optimizer and data position)"
                + "".join(f"\n  changed: {c}" for c in source.changes)
                + "".join(f"\n  parameter {n}" for n in notes)
            )
    writer = MetricsWriter(workdir, resume_step=start)
    schedule = lr_schedule(cfg.optim, cfg.steps)
    fault_step = int(os.environ.get(_FAULT_ENV, "0"))
    tokens_per_step = cfg.global_batch * cfg.seq_len
    result = RunResult(final_step=start, preempted=False, data_dir=data_dir)

    say = tqdm.write if distributed.is_main() else (lambda *a, **k: None)
    unfinished = [s for s in unfinished_saves(workdir) if s > start]
    stopped = f"the save of step {unfinished[-1]} did not finish (the run stopped during it)" if unfinished else ""
    if start:
        say(f"resuming {workdir} from step {start}" + (f": {stopped}" if stopped else ""))
    elif stopped:
        say(f"starting {workdir} from step 0: {stopped}, and no earlier step was saved")
    bar = None  # opened once the first step has compiled, so that its rate and ETA leave compilation out
    pending, last_time, rates, shown = None, time.perf_counter(), [], {}  # shown: the bar's postfix
    batch_log = _batch_log()
    val_batches = validation_batches(cfg, data_dir, batch_shards=math.prod(trainer.mesh.shape[a] for a in sharding.BATCH_AXES))

    def validate(step, params):
        scalars = {
            key: float(np.mean([jax.device_get(trainer.val_loss(params, jax.make_array_from_process_local_data(trainer.batch_sharding, b))) for b in batches]))
            for key, batches in val_batches.items()
        }
        writer.write(step, {**scalars, "tokens": step * cfg.global_batch * cfg.seq_len})  # tokens seen: the x of curves across runs
        # the bar shows the mean over the validation sources at the training length
        shown["val"] = f"{np.mean(list(curve_values(scalars).values())):.4f}"
        bar.set_postfix(shown, refresh=False)

    def flush(pending):
        step, metrics = pending
        m = jax.device_get(metrics)
        loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            saved = ckpt.last_saved_step()
            raise NonFiniteLoss(
                f"loss {loss} / grad norm {grad_norm} at step {step}: the run is stopped. "
                f"Last good checkpoint: {f'step {saved}' if saved else 'none'} in {ckpt.directory} (untouched)."
            )
        scalars = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": float(schedule(step - 1)),
            **{f"alpha/{k}": float(v) for k, v in m["alphas"].items()},
            **{k: float(m[k]) for k in ("ce", "align", "sparse_stream") if k in m},
        }
        if rates:
            scalars["tokens_per_s"] = tokens_per_step / float(np.median(rates[-20:]))
        writer.write(step, scalars)
        result.losses.append(loss)
        if step % cfg.log_every == 0 or step == cfg.steps:
            shown.update(loss=f"{loss:.4f}", **({"align": f"{scalars['align']:.4f}"} if "align" in scalars else {}))
            shown.update(tok_s=f"{scalars.get('tokens_per_s', 0):,.0f}")
            bar.set_postfix(shown, refresh=False)

    failing = True
    if preemption.requested:  # during the checks, the restore or the build: before the first step
        since = f"checkpoint step {start}, which is untouched" if start else "the start: there is no checkpoint yet"
        say(f"stopped by a signal before the first step: nothing was trained since {since}; run the same command to resume")
        _close_all([writer.close, *([batch_log.close] if batch_log else []), ckpt.close], failing=False)
        result.preempted = True
        return result
    try:
        with jax.set_mesh(mesh):
            for step in range(start, cfg.steps):
                local_BL = next(data_iter)  # this process's rows of the global batch
                if batch_log:
                    batch_log.write(json.dumps({"step": step + 1, "rows": [hashlib.sha1(r.tobytes()).hexdigest()[:12] for r in local_BL]}) + "\n")
                batch = jax.make_array_from_process_local_data(trainer.batch_sharding, local_BL)
                if bar is None:
                    say(f"compiling the training step (step {step + 1} runs once it is compiled) ...")
                    first = unless_stopped(lambda: jax.block_until_ready(trainer.step(state, batch)), preemption, mesh)
                    if first is None:
                        result.preempted = result.left_compiling = True
                        since = f"checkpoint step {start}, which is untouched" if start else "the start: there is no checkpoint yet"
                        say(f"stopped by a signal while compiling: nothing was trained since {since}; run the same command to resume")
                        break
                    state, metrics = first
                    say(f"compiled; step {step + 1} done in {time.perf_counter() - last_time:.1f} s")
                    bar = tqdm(total=cfg.steps, initial=step + 1, disable=not (progress and distributed.is_main()), unit="step", dynamic_ncols=True)
                else:
                    state, metrics = trainer.step(state, batch)
                ckpt.poll()  # a failed background save stops the run now, not at the next save
                if pending:
                    flush(pending)
                pending = (step + 1, metrics)
                now = time.perf_counter()
                if step > start:  # the first step's time is its compilation
                    rates.append(now - last_time)
                    if step + 1 < cfg.steps:
                        bar.update(1)
                    else:  # the last line is drawn once, by bar.close(), with the last loss and validation
                        bar.n += 1
                last_time = now
                # multi-process: agree at a fixed cadence, the same steps on every process, so the
                # all-gather does not stall the host behind every step it just dispatched
                stop = preemption.agreed() if jax.process_count() == 1 or (step + 1) % cfg.log_every == 0 else False
                if val_batches and ((step + 1) % cfg.eval.every_steps == 0 or step + 1 == cfg.steps):
                    flush(pending)  # the step's row first, then its validation row
                    pending = None
                    validate(step + 1, state["params"])
                if stop or (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == cfg.steps:
                    if pending:
                        flush(pending)
                    pending = None
                    ckpt.save(step + 1, state, data_iter, wait=stop or step + 1 == cfg.steps or fault_step == step + 1)
                    result.final_step = step + 1
                    if fault_step == step + 1:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if stop:
                        result.preempted = True
                        tqdm.write(f"stopped by a signal at step {step + 1}: checkpoint saved in {ckpt.directory}; run the same command to resume")
                        break
        failing = False
    except OSError as e:  # a full (or read-only) disk under the metrics or the events
        raise _write_failed(e, ckpt) from None
    finally:
        _close_all([*([bar.close] if bar else []), writer.close, *([batch_log.close] if batch_log else []), ckpt.close], failing=failing)
    if val_batches and not result.preempted and (summary := fit_summary(read_metrics(workdir), last=cfg.eval.every_steps)):
        say(summary)
    return result
