"""From a run directory to a model and tokenizer ready to sample, and the context limit.

The tokenizer is the run's data directory's tokenizer file (``data.path``, or
``<workdir>/data`` for the embedded corpus). It is checked for *before* the run is loaded:
loading would otherwise rebuild a missing embedded-corpus directory, and a checkpoint whose
tokenizer is gone should be reported, not silently paired with a new one.

Context limit (``context_limit``): a model with any full-cache (dense) layer takes at most its
training length unless told otherwise (dense attention is what collapses past its training
length, and its cache grows with every token); an offset model has no limit but memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from flax import nnx

from fibjax import kinds
from fibjax.config import TrainConfig, apply_overrides
from fibjax.data.token_files import tokenizer_path
from fibjax.data.tokenizer import Tokenizer
from fibjax.decode.sampling import SampleError
from fibjax.model import graphdef_of
from fibjax.run.load import load_run, run_tokenizer, with_attention
from fibjax.run.workdir import data_dir_of, load_run_config


@dataclass
class SamplingRun:
    cfg: TrainConfig
    step: int
    model: object  # fibjax.model.Transformer with the checkpoint's parameters
    tokenizer: Tokenizer


def load(workdir: str | Path, step: int | None = None, attention_overrides: list[str] | None = None) -> SamplingRun:
    """The run's model at ``step`` (default: the latest checkpoint) and its tokenizer; with
    ``attention_overrides`` (key=value, e.g. from ``--inference-mode sparse``) its weights under
    that attention."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise SampleError(f"run directory {str(workdir)!r} does not exist")
    cfg = load_run_config(workdir)
    path = tokenizer_path(data_dir_of(cfg, workdir))
    if not path.is_file():
        raise SampleError(
            f"{workdir} has no tokenizer: {path} is missing (the run's data directory holds the tokenizer its "
            "checkpoints were trained with; restore it, or the data directory named by data.path)"
        )
    run = load_run(workdir, step)  # checks the tokenizer against the one the run trained with
    tokenizer = run_tokenizer(run)
    params, model_cfg = run.params, cfg.model
    if attention_overrides:
        params, model_cfg = with_attention(run, apply_overrides(cfg.model.attention, attention_overrides))
        # SSA's two streams are a way of training: the model decodes under the one attention chosen
        cfg = dataclasses.replace(cfg, model=model_cfg, ssa=dataclasses.replace(cfg.ssa, enabled=False))
    return SamplingRun(cfg, run.step, nnx.merge(graphdef_of(model_cfg), params), tokenizer)


def context_limit(cfg: TrainConfig, max_context: int | None = None) -> int | None:
    """Most tokens (prompt + new) a decode may hold: ``max_context`` when given; else the
    training length for a model with dense layers, None (memory only) for offset models."""
    if max_context is not None:
        return max_context
    return cfg.seq_len if kinds.kind_of(cfg.model.attention).bounded_context else None


def check_prompt_text(text: str) -> None:
    if not text:
        raise SampleError("the prompt is empty: give at least one character of text to continue")


def encode_prompt(tokenizer: Tokenizer, text: str, max_new_tokens: int, limit: int | None) -> list[int]:
    """The prompt's token ids, or SampleError when it is empty or the decode would not fit. A
    prompt begins a document: with BOS first where the tokenizer's source model puts one."""
    if max_new_tokens < 1:
        raise SampleError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_prompt_text(text)
    ids = tokenizer.document_start + tokenizer.encode(text)
    if limit is not None and len(ids) >= limit:
        raise SampleError(
            f"the prompt is {len(ids)} tokens, but this model takes at most {limit} tokens in all (prompt + new); shorten the prompt or raise --max-context"
        )
    if limit is not None and len(ids) + max_new_tokens > limit:
        raise SampleError(
            f"the prompt ({len(ids)} tokens) + {max_new_tokens} new tokens exceeds this model's limit of {limit} "
            f"tokens; ask for at most {limit - len(ids)} new tokens or raise --max-context"
        )
    return ids
