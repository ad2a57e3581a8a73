"""The training loop: data, sharded state, resume, metrics, checkpoints, preemption.

``train(cfg, workdir)`` is the whole run; ``launch.train`` only parses arguments. Metrics of
step N are read after step N+1 is dispatched (no host stall per step); a checkpoint is written
only after the metrics of the update that produced it were checked finite, so a NaN never
reaches disk.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from fibjax import data as data_lib
from fibjax import distributed
from fibjax.config import ConfigError, TrainConfig, parse_weights
from fibjax.data.token_files import open_tokens
from fibjax.train import sharding
from fibjax.train.checkpoint import Checkpointer, claim_workdir, pin_tokenizer
from fibjax.train.metrics import MetricsWriter
from fibjax.train.optimizer import lr_schedule
from fibjax.train.step import build

# Test-only fault injection: SIGKILL this process right after the checkpoint of this step is
# on disk, to test exact resume after a crash deterministically.
_FAULT_ENV = "FIBJAX_FAULT_AFTER_SAVE"
# Test-only: append each step's row hashes to <dir>/batches.<process>.jsonl, to check that the
# processes feed different rows that together make the 1-process batch.
_BATCH_LOG_ENV = "FIBJAX_LOG_BATCHES"


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class RunResult:
    final_step: int
    preempted: bool
    data_dir: Path
    losses: list[float] = field(default_factory=list)


def resolve_data_dir(cfg: TrainConfig, workdir: Path) -> Path:
    """The prepared dataset to train on: ``data.path``, or the embedded corpus in the workdir."""
    if cfg.data.path:
        return Path(cfg.data.path)
    # one writer; the others wait for it (shared filesystem)
    distributed.on_main(lambda: data_lib.prepare_default(Path(workdir) / "data", cfg.data.default_vocab_size), "preparing the default corpus")
    return Path(workdir) / "data"


def check_data(cfg: TrainConfig, data_dir: Path, workdir: Path) -> None:
    """The data's tokenizer fits the model and is the one the run started with."""
    tokenizer = data_lib.load_meta(data_dir)["tokenizer"]
    distributed.on_main(lambda: pin_tokenizer(workdir, tokenizer["sha256"]), "checking the run's tokenizer")
    vocab = tokenizer["vocab_size"]
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({vocab}) in {data_dir}")


class _Preemption:
    """SIGTERM / SIGINT set a flag; the loop saves at the next step boundary and exits."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def agreed(self) -> bool:
        """True on every process if any process was asked to stop (all must save together)."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested))))


def validation_batches(cfg: TrainConfig, data_dir: Path) -> dict[str, np.ndarray]:
    """Per validation source, this process's rows of fixed batches [N, rows, T+1] for the
    validation curve: the source's first ``eval.curve_tokens`` tokens cut into windows of
    seq_len + 1 (a whole number of global batches; a source too short for one is left out)."""
    if not cfg.eval.every_steps:
        return {}
    meta = data_lib.load_meta(data_dir)
    t, rows = cfg.seq_len + 1, cfg.global_batch
    per_process = rows // jax.process_count()
    out = {}
    for name in data_lib.validation_sources(meta):
        stream = open_tokens(data_dir, meta, name, "val")
        n = min(cfg.eval.curve_tokens // cfg.seq_len, len(stream) // t) // rows
        if n:
            batches = np.asarray(stream[: n * rows * t], dtype=np.int32).reshape(n, rows, t)
            out[name] = batches[:, jax.process_index() * per_process:(jax.process_index() + 1) * per_process]
    return out


def _batch_log():
    if not os.environ.get(_BATCH_LOG_ENV):
        return None
    return (Path(os.environ[_BATCH_LOG_ENV]) / f"batches.{jax.process_index()}.jsonl").open("a", buffering=1)


def train(cfg: TrainConfig, workdir: str | Path, *, progress: bool = True) -> RunResult:
    distributed.initialize()
    workdir = Path(workdir)
    distributed.on_main(lambda: claim_workdir(workdir, cfg), f"claiming the workdir {workdir}")  # one writer of config.json
    data_dir = resolve_data_dir(cfg, workdir)
    check_data(cfg, data_dir, workdir)
    if cfg.global_batch % jax.process_count():
        raise ConfigError(f"global_batch: {cfg.global_batch} is not divisible by the {jax.process_count()} processes")

    mesh = sharding.make_mesh(cfg.mesh)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.global_batch % batch_shards:
        raise ConfigError(f"global_batch: {cfg.global_batch} is not divisible by data x fsdp = {batch_shards}")
    trainer = build(cfg, mesh)
    data_iter = data_lib.train_iterator(
        data_dir, parse_weights(cfg.data.weights), seq_len=cfg.seq_len, global_batch=cfg.global_batch, seed=cfg.seed,
        process_index=jax.process_index(), process_count=jax.process_count(), worker_count=cfg.data.worker_count,
    )
    ckpt = Checkpointer(workdir, cfg.checkpoint)
    start = ckpt.latest_step() or 0
    state = ckpt.restore(start, trainer.abstract_state, data_iter) if start else trainer.init()
    writer = MetricsWriter(workdir, resume_step=start)
    schedule = lr_schedule(cfg.optim, cfg.steps)
    fault_step = int(os.environ.get(_FAULT_ENV, "0"))
    tokens_per_step = cfg.global_batch * cfg.seq_len
    result = RunResult(final_step=start, preempted=False, data_dir=data_dir)

    bar = tqdm(total=cfg.steps, initial=start, disable=not (progress and distributed.is_main()), unit="step", dynamic_ncols=True)
    if start and distributed.is_main():
        tqdm.write(f"resuming {workdir} from step {start}")
    pending, last_time, rates = None, time.perf_counter(), []
    batch_log = _batch_log()
    val_batches = validation_batches(cfg, data_dir)

    def validate(step, params):
        scalars = {f"val/{name}": float(np.mean([jax.device_get(trainer.val_loss(params, jax.make_array_from_process_local_data(trainer.batch_sharding, b)))
                                                  for b in batches])) for name, batches in val_batches.items()}
        writer.write(step, scalars)

    def flush(pending):
        step, metrics = pending
        m = jax.device_get(metrics)
        loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            saved = ckpt.latest_step()
            raise NonFiniteLoss(
                f"loss {loss} / grad norm {grad_norm} at step {step}: the run is stopped. "
                f"Last good checkpoint: {f'step {saved}' if saved else 'none'} in {ckpt.directory} (untouched)."
            )
        scalars = {"loss": loss, "grad_norm": grad_norm, "lr": float(schedule(step - 1)), **{f"alpha/{k}": float(v) for k, v in m["alphas"].items()},
                   **{k: float(m[k]) for k in ("ce", "align", "sparse_stream") if k in m}}
        if rates:
            scalars["tokens_per_s"] = tokens_per_step / float(np.median(rates[-20:]))
        writer.write(step, scalars)
        result.losses.append(loss)
        if step % cfg.log_every == 0 or step == cfg.steps:
            extra = {"align": f"{scalars['align']:.4f}"} if "align" in scalars else {}
            bar.set_postfix(loss=f"{loss:.4f}", **extra, tok_s=f"{scalars.get('tokens_per_s', 0):,.0f}", refresh=False)

    try:
        with _Preemption() as preemption, jax.set_mesh(mesh):
            for step in range(start, cfg.steps):
                local_BL = next(data_iter)  # this process's rows of the global batch
                if batch_log:
                    batch_log.write(json.dumps({"step": step + 1, "rows": [hashlib.sha1(r.tobytes()).hexdigest()[:12] for r in local_BL]}) + "\n")
                batch = jax.make_array_from_process_local_data(trainer.batch_sharding, local_BL)
                state, metrics = trainer.step(state, batch)
                if pending:
                    flush(pending)
                pending = (step + 1, metrics)
                now = time.perf_counter()
                rates.append(now - last_time)
                last_time = now
                bar.update(1)
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
    finally:
        bar.close()
        writer.close()
        if batch_log:
            batch_log.close()
        ckpt.close()
    return result
