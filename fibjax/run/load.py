"""A run loaded for evaluation or decoding: its config, the parameters of one checkpoint (no
optimizer state), its data directory and the tokenizer it trained with.

The data must still hold that tokenizer (checked against the run's pin, ``workdir.py``); for a
run on the embedded corpus whose data directory is gone, it is prepared again first.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from fibjax import data as data_lib
from fibjax import kinds
from fibjax.attention import alpha as alpha_lib
from fibjax.config import AttentionConfig, TrainConfig
from fibjax.data.token_files import data_tokenizer
from fibjax.data.tokenizer import Tokenizer
from fibjax.run.checkpoints import Checkpointer, DamagedCheckpoint
from fibjax.run.integrity import finished_steps
from fibjax.run.workdir import CONFIG_FILE, CheckpointError, load_run_config, pinned_tokenizer, resolve_data_dir, verify_data

# how many times an evaluation reads the latest step again when training deletes the one it reads
DELETED_RETRIES = 3


@dataclass
class LoadedRun:
    """A run's config and one checkpoint's parameters ([load_run][fibjax.run.load_run])."""

    cfg: TrainConfig
    step: int
    params: dict
    data_dir: Path
    tokenizer_sha256: str
    workdir: Path


def load_run(workdir: str | Path, step_number: int | None = None) -> LoadedRun:  # noqa: DOC503
    """The run's config and the parameters of ``step_number`` (default: the latest checkpoint).

    Args:
        workdir: The run directory.
        step_number: The checkpoint (default: the latest).

    Returns:
        The loaded run.

    Raises:
        CheckpointError: Not a run, no finished checkpoint, or a damaged one.
    """
    workdir = Path(workdir)
    cfg = load_run_config(workdir)
    if not finished_steps(workdir):  # checked before the Checkpointer, which would create checkpoints/
        raise CheckpointError(
            f"{workdir} has no finished checkpoint yet: it saves its first at step {cfg.checkpoint.every_steps} "
            f"(checkpoint.every_steps); train it (the command that started it, with --workdir {workdir}) and evaluate it then"
        )
    ckpt = Checkpointer(workdir, cfg.checkpoint, model=cfg.model, model_source=f"in {workdir / CONFIG_FILE}")
    try:
        chosen, params = _restore_held(ckpt, cfg, step_number)
    finally:
        ckpt.close()
    data_dir = resolve_data_dir(cfg, workdir)
    # the data must still hold the tokenizer the run trained with (load_meta also checks the file)
    meta = data_lib.load_meta(data_dir, tokenizer_sha256=pinned_tokenizer(workdir))
    verify_data(workdir, data_dir, meta)
    sha = meta["tokenizer"]["sha256"]
    return LoadedRun(cfg, chosen, params, data_dir, sha, workdir)


def _restore_held(ckpt: Checkpointer, cfg: TrainConfig, step_number: int | None) -> tuple[int, dict]:
    """(step, parameters) of ``step_number``, default the latest, held against deletion by a run
    training beside the evaluation (``Checkpointer.held``). Where it cannot be held, or was
    being deleted already, and its directory is gone, the latest step is read instead (unless
    one was asked for), saying so."""
    chosen = step_number
    for _ in range(DELETED_RETRIES):
        steps = ckpt.all_steps()
        chosen = steps[-1] if step_number is None and steps else chosen
        if chosen not in steps:
            raise CheckpointError(f"{ckpt.directory.parent} has no checkpoint for step {chosen}; available: {steps}")
        try:
            # on this process's first device: a pod's processes each restore a copy, and the
            # evaluation replicates it over the mesh (eval_mesh)
            with ckpt.held(chosen) as source:
                return chosen, source.restore_params(chosen, abstract_params(cfg.model, jax.local_devices()[0]))
        except CheckpointError as e:
            if not _deleted(ckpt, chosen):
                earlier = ckpt.latest_intact_step(before=e.step) if isinstance(e, DamagedCheckpoint) else None
                raise CheckpointError(f"{e}" + (f" Evaluate step {earlier} instead with --step {earlier}." if earlier else "")) from None
        ckpt.reload()
        now = ckpt.all_steps()
        if step_number is not None or not now:
            raise CheckpointError(
                f"checkpoint step {chosen} in {ckpt.directory} was deleted while it was read (a run training there keeps "
                f"checkpoint.keep={cfg.checkpoint.keep} steps); its steps now: {now}: evaluate one of them with --step"
            )
        keep = f"checkpoint.keep={cfg.checkpoint.keep}"
        print(f"warning: checkpoint step {chosen} was deleted while it was read ({keep}); reading step {now[-1]}, now the latest", file=sys.stderr)
    raise CheckpointError(f"checkpoints in {ckpt.directory} were deleted {DELETED_RETRIES} times while read: evaluate once the run there has ended")


def _deleted(ckpt: Checkpointer, step: int) -> bool:
    """Whether ``step`` is being deleted: its directory is gone, at once or within a few seconds
    (the files of a big step take a moment to delete)."""
    for _ in range(20):
        if not (ckpt.directory / str(step)).is_dir():
            return True
        time.sleep(0.1)
    return False


def abstract_params(model_cfg, device) -> dict:
    """ShapeDtypeStructs of the model's parameters, placed on ``device`` (nothing allocated)."""
    from flax import nnx

    from fibjax.model import Transformer

    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))), nnx.Param))
    place = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place), shapes)


def run_tokenizer(run: LoadedRun) -> Tokenizer:
    """The tokenizer the run trained with (``load_run`` checked it against the run's record)."""
    return data_tokenizer(run.data_dir)


def _holds_nsa_params(acfg: AttentionConfig) -> bool:
    return acfg.nsa_params or kinds.kind_of(acfg).params_needed


def with_attention(run: LoadedRun, attention: AttentionConfig) -> tuple[dict, object]:
    """(params, model config) for evaluating the run's weights under another attention.

    Weights carry over unchanged; a learned layer's alpha_logit is dropped when the override has
    none, and created from the override's schedule when the override learns alpha. A run whose
    layers hold NSA's parameters (an NSA model, or SSA with an NSA stream) keeps them under any
    other attention (``nsa_params``: carried, unused), so its checkpoint still fits the model."""
    if _holds_nsa_params(run.cfg.model.attention) and not _holds_nsa_params(attention):
        attention = dataclasses.replace(attention, nsa_params=True)
    model_cfg = dataclasses.replace(run.cfg.model, attention=attention)
    blocks = {}
    for i, block in run.params["blocks"].items():
        attn = {k: v for k, v in block["attn"].items() if k != alpha_lib.PARAM}
        if attention.is_learned:
            start = alpha_lib.alpha_to_logit(attention.layer_alphas(model_cfg.num_layers)[i])
            attn[alpha_lib.PARAM] = block["attn"].get(alpha_lib.PARAM, np.float32(start))
        blocks[i] = {**block, "attn": attn}
    return {**run.params, "blocks": blocks}, model_cfg
