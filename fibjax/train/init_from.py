"""Continual training: a new run that starts from another run's parameters.

Paper B pre-trains at 8k tokens and continues at 32k. ``init_from="RUN"`` (or ``"RUN:STEP"``)
in a config starts a new run from the parameters of RUN's checkpoint (the latest, or STEP): a
fresh optimizer (zero moments, the warm-up again) and a fresh data position; only the weights
carry over. On resume the run's own checkpoints take over and ``init_from`` is not read again.

What may change against the source run (``check_compatible``): anything that leaves the
parameter shapes and the model's function of them intact: ``seq_len``, RoPE (theta, scaling),
the attention (kind, window, rungs, alphas, block budget), SSA, the optimizer, data, mesh,
steps, seed. What may not: the fields in ``FIXED`` (they set the parameter shapes or how a
parameter is read), and the tokenizer (the embedding rows would mean other tokens).
A learned alpha carries over when both runs learn it in that layer; a run that starts to
learn alpha takes its schedule's initial value; a learned alpha the new run does not learn
is dropped (its attention says which alphas it uses).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from fibjax import sharding
from fibjax.config import ConfigError, TrainConfig
from fibjax.run.checkpoints import Checkpointer, DamagedCheckpoint
from fibjax.run.workdir import CheckpointError, changed_fields, load_run_config, pinned_tokenizer

# model fields that must equal the source run's (parameter shapes, or how parameters are read)
FIXED = (
    *("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "resolved_head_dim", "resolved_mlp_hidden"),
    *("norm_eps", "param_dtype", "qkv_bias", "tie_embeddings"),
)


@dataclasses.dataclass(frozen=True)
class Source:
    workdir: Path
    step: int
    cfg: TrainConfig
    tokenizer_sha256: str | None
    changes: tuple[str, ...]  # the allowed config differences, "field: old -> new"


def parse(spec: str) -> tuple[Path, int | None]:
    """``"RUN"`` or ``"RUN:STEP"`` (a path may itself hold colons: only a numeric tail is a step)."""
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit() and head:
        return Path(head), int(tail)
    if sep and head and not tail.isdigit() and "/" not in tail:
        raise ConfigError(f"init_from: {spec!r}: the part after ':' must be a checkpoint step (RUN or RUN:STEP)")
    return Path(spec), None


def check_compatible(source: TrainConfig, cfg: TrainConfig, where: str) -> list[str]:
    """The allowed differences (``"seq_len: 256 -> 1024"``), or ConfigError naming the forbidden ones."""
    bad = [
        f"model.{name}: {getattr(source.model, name)} in {where}, {getattr(cfg.model, name)} here"
        for name in FIXED
        if getattr(source.model, name) != getattr(cfg.model, name)
    ]
    if bad:
        raise ConfigError(
            "init_from: the parameters of "
            + where
            + " do not fit this model ("
            + "; ".join(bad)
            + "). Only fields that keep the parameter shapes may change: seq_len, rope_*, attention, ssa, optim, data, steps, seed"
        )
    return [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed_fields(source, cfg).items() if k not in ("name", "init_from")]


def locate(cfg: TrainConfig) -> Source:
    """The source run of ``cfg.init_from``, checked: a run directory with that checkpoint, whose
    model fits ``cfg``. Reads only (runs in the preflight, before the new workdir is claimed)."""
    workdir, step = parse(cfg.init_from)
    if not (workdir / "config.json").exists():
        raise ConfigError(f"init_from: {workdir} is not a run directory (no config.json)")
    source_cfg = load_run_config(workdir)
    ckpt = Checkpointer(workdir, source_cfg.checkpoint)
    try:
        steps = ckpt.all_steps()
    finally:
        ckpt.close()
    if not steps:
        raise CheckpointError(f"init_from: {workdir} has no checkpoint yet")
    if step is not None and step not in steps:
        raise CheckpointError(f"init_from: {workdir} has no checkpoint of step {step}; its steps: {steps}")
    changes = tuple(check_compatible(source_cfg, cfg, str(workdir)))
    return Source(workdir, steps[-1] if step is None else step, source_cfg, pinned_tokenizer(workdir), changes)


def check_tokenizer(source: Source, tokenizer_sha256: str) -> None:
    if source.tokenizer_sha256 and source.tokenizer_sha256 != tokenizer_sha256:
        raise ConfigError(
            f"init_from: {source.workdir} trained with another tokenizer (sha256 {source.tokenizer_sha256[:12]}...) than this "
            f"run's data ({tokenizer_sha256[:12]}...): its embedding rows would mean other tokens"
        )


def source_params(source: Source, mesh: jax.sharding.Mesh) -> dict:
    """The source checkpoint's parameters, sharded on ``mesh`` by the same logical-axis rules."""
    from fibjax.model import Transformer

    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(source.cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
    shardings = sharding.param_shardings(abstract, mesh)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nnx.to_pure_dict(abstract), shardings)
    ckpt = Checkpointer(source.workdir, source.cfg.checkpoint, model=source.cfg.model, model_source=f"in {source.workdir / 'config.json'}")
    try:
        return ckpt.restore_params(source.step, target)
    except DamagedCheckpoint as e:
        raise CheckpointError(f"init_from: {e}") from None
    finally:
        ckpt.close()


def merge(fresh: dict, loaded: dict) -> tuple[dict, list[str]]:
    """``fresh`` (the new run's initial parameters) with every leaf ``loaded`` also has replaced
    by the loaded one; returns the result and the paths only one side has (learned alphas)."""
    only = []

    def walk(f, lo, path):
        if not isinstance(f, dict):
            return lo
        out = {}
        for k, v in f.items():
            if k in lo:
                out[k] = walk(v, lo[k], f"{path}/{k}")
            else:
                out[k] = v
                only.append(f"{path}/{k} (new: initial value)")
        only.extend(f"{path}/{k} (dropped)" for k in lo if k not in f)
        return out

    return walk(fresh, loaded, ""), only


def initial_state(state: dict, source: Source, mesh: jax.sharding.Mesh) -> tuple[dict, list[str]]:
    """The new run's step-0 state with the source run's parameters in it (optimizer moments and
    counters are the fresh ones: zeros, step 0). Returns it and the parameter-set differences."""
    params, notes = merge(state["params"], source_params(source, mesh))
    return {**state, "params": params}, notes
