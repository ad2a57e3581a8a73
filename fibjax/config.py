"""Typed, validated configuration: frozen dataclasses, ``key=value`` overrides, JSON I/O.

Every dataclass validates itself in ``__post_init__`` and raises [ConfigError][fibjax.config.ConfigError] naming
the field; overrides name the full dotted path. Config files under ``configs/`` are Python
modules with ``get_config() -> Config``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import json
import traceback
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from fibjax.attention import alpha as alpha_lib
from fibjax.attention import offsets
from fibjax.errors import FibjaxError

# a config dataclass (TrainConfig or one of its sections)
C = typing.TypeVar("C")


class ConfigError(FibjaxError, ValueError):
    """A config value or key is invalid; the message names the field."""


def _require(ok: bool, name: str, message: str, value) -> None:
    if not ok:
        raise ConfigError(f"{name}: {message} (got {value!r})")


@dataclass(frozen=True)
class AttentionConfig:
    """Attention of every layer. ``kind``: a registered attention kind (``fibjax.kinds``): dense |
    offset (paper A) | block_sparse (MoBA, paper B) | nsa (NSA, paper B's gated baseline:
    compressed blocks + selected blocks + window) | window (the last W keys) | sinks (the first
    S positions + the last W keys, StreamingLLM) | one of your own."""

    # the attention every layer runs: a kind registered in fibjax.kinds (dense | offset |
    # block_sparse | nsa | window | sinks, or one of your own)
    kind: str = "dense"
    # offset: the dense local window {0..W}, W + 1 keys; nsa: the window branch's keys i-W .. i;
    # window and sinks: the last W keys, itself included (0 <= i - j < W: W keys, Mistral's
    # sliding_window), so offset's W8 window is window=9
    window: int = 12
    # sinks: the first S positions every query also attends (StreamingLLM's attention sinks; its
    # paper found 4 enough to hold the softmax mass that the first tokens draw)
    sinks: int = 4
    # offset: the rungs f scaled by alpha: fibonacci (1, 2, 3, 5, ..., 987), pow2 (every power of two
    # below the evaluated length) or explicit positive ints
    base: str | tuple[int, ...] = "fibonacci"
    # keep only rungs <= max_rung (0: the whole list); stored with the run, so evaluation at a
    # longer length keeps the trained rungs. Not for pow2 (reach-matched by definition).
    max_rung: int = 0
    # fixed | staggered | coprime | learned, or one alpha per layer
    alpha: str | tuple[float, ...] = "fixed"
    # learn alpha starting from the schedule above ("learned" alone starts every layer at 1.0)
    learn_alpha: bool = False
    # the learned path's interpolated rungs with fixed alphas: how a learned run is evaluated
    # and decoded after training (its final alphas compiled as constants, same numbers, faster)
    interpolate: bool = False
    # block_sparse and nsa: keys per block (nsa: also the compression block)
    block_size: int = 16
    # block_sparse and nsa: blocks each query attends, its own block included
    num_blocks: int = 16
    # how block_sparse ranks earlier blocks: mean_key = (sum of the group's q) . mean key;
    # nsa_prob = sum over the group of per-head softmax probabilities (NSA's rule; nsa always uses it)
    block_rank: str = "mean_key"
    # build NSA's parameters (gates, compression) though kind != nsa: SSA with ssa.sparse_kind=nsa,
    # whose model attention is the dense full stream
    nsa_params: bool = False
    # offset and block_sparse kinds: None is XLA until the kernels pass their hardware check
    # (pallas.backend.PALLAS_BY_DEFAULT); "xla" or "pallas" forces one. window: None (or
    # "pallas") is cuDNN's sliding window on a GPU where cuDNN takes it, else XLA; "xla" forces XLA
    implementation: str | None = None

    def __post_init__(self):
        from fibjax.kinds import registry

        _require(self.kind in registry.names(), "kind", f"must be a registered attention kind: {', '.join(registry.names())}", self.kind)
        _require(self.window >= 0, "window", "must be >= 0", self.window)
        _require(self.sinks >= 0, "sinks", "must be >= 0", self.sinks)
        for name, least in registry.minimums(self.kind).items():
            _require(getattr(self, name) >= least, name, f"must be >= {least} for kind {self.kind}", getattr(self, name))
        if isinstance(self.base, str):
            _require(self.base in ("fibonacci", "pow2"), "base", "must be fibonacci, pow2 or a tuple of ints", self.base)
        else:
            _require(len(self.base) > 0 and all(isinstance(f, int) and f >= 1 for f in self.base), "base", "an explicit base must be positive ints", self.base)
        _require(self.max_rung >= 0, "max_rung", "must be >= 0 (0 = no bound)", self.max_rung)
        _require(not (self.max_rung and self.base == "pow2"), "max_rung", "does not apply to base pow2 (reach-matched at the evaluated length)", self.max_rung)
        if self.max_rung and not isinstance(self.base, str):
            _require(min(self.base) <= self.max_rung, "max_rung", f"leaves no rung of base {self.base}", self.max_rung)
        if isinstance(self.alpha, str):
            _require(self.alpha in alpha_lib.SCHEDULES, "alpha", f"must be one of {alpha_lib.SCHEDULES} or a tuple of floats", self.alpha)
        else:
            bad = [a for a in self.alpha if not alpha_lib.ALPHA_MIN <= a <= alpha_lib.ALPHA_MAX]
            _require(len(self.alpha) > 0 and not bad, "alpha", "explicit alphas must lie in [0.5, 1.5]", self.alpha)
        _require(self.block_size >= 1, "block_size", "must be >= 1", self.block_size)
        _require(self.num_blocks >= 1, "num_blocks", "must be >= 1", self.num_blocks)
        _require(self.block_rank in ("mean_key", "nsa_prob"), "block_rank", "must be mean_key or nsa_prob", self.block_rank)
        _require(self.implementation in (None, "xla", "pallas"), "implementation", "must be None, xla or pallas", self.implementation)

    @property
    def bounded_base(self) -> str | tuple[int, ...]:
        """The base the attention functions receive: ``base`` bounded by ``max_rung``."""
        return offsets.bounded_base(self.base, self.max_rung)

    @property
    def has_alpha(self) -> bool:
        """The layers have a rung scale alpha (paper A's offsets)."""
        from fibjax.kinds import registry

        return registry.get(self.kind).has_alpha

    @property
    def is_learned(self) -> bool:
        from fibjax.kinds import registry

        return registry.get(self.kind).learns_alpha(self)

    def layer_alphas(self, num_layers: int) -> tuple[float, ...]:  # noqa: DOC502
        """Alpha of every layer (the initial values when learned).

        Args:
            num_layers: The number of layers.

        Returns:
            One alpha per layer.

        Raises:
            ConfigError: An explicit alpha list whose length is not ``num_layers``.
        """
        if isinstance(self.alpha, str):
            return alpha_lib.alpha_schedule(self.alpha, num_layers)
        _require(len(self.alpha) == num_layers, "alpha", f"needs one value per layer ({num_layers})", self.alpha)
        return tuple(float(a) for a in self.alpha)


REMAT_POLICIES = ("none", "full", "dots")
ROPE_SCALINGS = ("none", "ntk", "linear", "yarn", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder-only LM. 0 for head_dim / mlp_hidden means "derive from d_model"."""

    # rows of the (tied) embedding: at least the tokenizer's vocabulary
    vocab_size: int = 32768
    # width of the residual stream
    d_model: int = 512
    # transformer blocks
    num_layers: int = 16
    # query heads per layer
    num_heads: int = 8
    # key/value heads per layer (grouped-query attention); must divide num_heads
    num_kv_heads: int = 2
    # per-head width (0: d_model // num_heads); must be even (RoPE rotates pairs)
    head_dim: int = 0
    # SwiGLU hidden width (0: 8/3 d_model, rounded up to even)
    mlp_hidden: int = 0
    # RoPE base: head-dim pair i rotates at rope_theta^(-2i/head_dim) per position
    rope_theta: float = 10000.0
    # RoPE scaling for a longer context (training, evaluation and decoding alike): none | ntk
    # (theta raised) | linear (position interpolation) | yarn (needs rope_original_len) | llama3
    # (Llama 3.1's frequency bands; needs rope_original_len)
    rope_scaling: str = "none"
    # how many times longer the context becomes under rope_scaling (>= 1)
    rope_factor: float = 1.0
    # yarn and llama3: the length the model was pre-trained at (0: unset)
    rope_original_len: int = 0
    # llama3: frequencies whose wavelength is longer than rope_original_len / low_freq_factor
    # are divided by rope_factor (a ramp up to the high_freq_factor bound)
    rope_low_freq_factor: float = 1.0
    # llama3: frequencies whose wavelength is shorter than rope_original_len / high_freq_factor
    # are kept as they are
    rope_high_freq_factor: float = 4.0
    # epsilon of every RMSNorm
    norm_eps: float = 1e-6
    # biases on the query, key and value projections (Qwen2); the output projection has none
    qkv_bias: bool = False
    # the output projection is the embedding table (tied), or a matrix of its own (lm_head)
    tie_embeddings: bool = True
    # float32 | bfloat16: the dtype activations and matmuls compute in (softmax statistics and
    # the loss stay float32)
    dtype: str = "float32"
    # float32 | bfloat16: the dtype parameters (and the optimizer's moments) are stored in
    param_dtype: str = "float32"
    # activation checkpointing of each block: none | full (store only the block's input) | dots
    # (keep the matmul outputs, recompute the rest); true/false are read as full/none
    remat: bool | str = "none"
    # run the blocks as one jax.lax.scan over their stacked parameters, so the step compiles
    # one block whatever the depth (the checkpoint keeps one entry per layer); needs every layer
    # to run the same program: not staggered or coprime static offsets
    scan_layers: bool = False
    # positions per chunk of the output projection + loss (0: all at once): memory only, the
    # [batch, seq, vocab] logits are never materialised in the loss or evaluation when > 0
    logits_chunk: int = 0
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads"):
            _require(getattr(self, name) >= 1, name, "must be >= 1", getattr(self, name))
        _require(self.num_heads % self.num_kv_heads == 0, "num_heads", f"must be divisible by num_kv_heads ({self.num_kv_heads})", self.num_heads)
        _require(self.head_dim >= 0 and self.mlp_hidden >= 0, "head_dim/mlp_hidden", "must be >= 0", (self.head_dim, self.mlp_hidden))
        if self.head_dim == 0:
            _require(self.d_model % self.num_heads == 0, "d_model", f"must be divisible by num_heads ({self.num_heads}) unless head_dim is set", self.d_model)
        _require(self.resolved_head_dim % 2 == 0, "head_dim", "must be even (RoPE rotates pairs)", self.resolved_head_dim)
        _require(self.rope_theta > 0, "rope_theta", "must be > 0", self.rope_theta)
        _require(self.rope_scaling in ROPE_SCALINGS, "rope_scaling", f"must be one of {', '.join(ROPE_SCALINGS)}", self.rope_scaling)
        _require(self.rope_factor >= 1.0, "rope_factor", "must be >= 1 (the context grows by this factor)", self.rope_factor)
        needs_len = self.rope_scaling in ("yarn", "llama3")
        _require(not needs_len or self.rope_original_len >= 1, "rope_original_len", f"{self.rope_scaling} needs the pretraining length", self.rope_original_len)
        _require(
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
            "rope_low_freq_factor",
            f"must be > 0 and below rope_high_freq_factor ({self.rope_high_freq_factor})",
            self.rope_low_freq_factor,
        )
        _require(self.logits_chunk >= 0, "logits_chunk", "must be >= 0 (0 = no chunking)", self.logits_chunk)
        for name in ("dtype", "param_dtype"):
            _require(getattr(self, name) in ("float32", "bfloat16"), name, "must be float32 or bfloat16", getattr(self, name))
        if isinstance(self.remat, bool):  # the earlier boolean field: stored run configs still say true/false
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        _require(self.remat in REMAT_POLICIES, "remat", f"must be one of {', '.join(REMAT_POLICIES)}", self.remat)
        if self.scan_layers:
            from fibjax.kinds import registry

            problem = registry.kind_of(self.attention).scan_problem(self.attention, self.num_layers)
            _require(problem is None, "scan_layers", problem or "", True)
        if not isinstance(self.attention.alpha, str):
            self.attention.layer_alphas(self.num_layers)  # explicit alphas: one per layer

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def resolved_mlp_hidden(self) -> int:
        """SwiGLU hidden size: int(d_model * 8/3) rounded up to even (the reference's rule)."""
        return self.mlp_hidden or (int(self.d_model * 8 / 3) + 1) // 2 * 2


@dataclass(frozen=True)
class DataConfig:
    """Training data: the prepared directory to read and how its sources mix."""

    # a directory written by python -m launch.prepare_data; "" = the embedded corpus, prepared
    # into <workdir>/data on first use
    path: str = ""
    # "fineweb=0.35,wikipedia=0.22,..." sampling weights by source name; "" = proportional to tokens
    weights: str = ""
    # vocabulary of the tokenizer trained for the embedded default corpus
    default_vocab_size: int = 2048
    # the command that prepares ``path`` (the paper recipes set it): a run whose data is missing
    # fails at start with this command in its message
    prepare: str = ""
    # Grain read threads per process (0 = read in the main thread)
    worker_count: int = 0

    def __post_init__(self):
        # 256 byte pieces + specials + the corpus's characters need 346 on Python 3.11's docs
        _require(self.default_vocab_size >= 384, "default_vocab_size", "must be >= 384", self.default_vocab_size)
        _require(self.worker_count >= 0, "worker_count", "must be >= 0", self.worker_count)
        parse_weights(self.weights)


def parse_weights(text: str) -> dict[str, float]:
    """ "a=0.6,b=0.4" -> {"a": 0.6, "b": 0.4}; raises ConfigError naming ``data.weights``."""
    out: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            w = float(value)
        except ValueError:
            w = -1.0
        _require(bool(sep) and bool(name) and w > 0, "weights", "expected name=positive_number pairs separated by commas", text)
        out[name.strip()] = w
    return out


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay (the paper's recipe by default).

    Weight decay applies to matrices (ndim >= 2) only: not to norms or the learned alpha
    scalars (as in the reference); the alpha scalars get ``alpha_lr_multiplier`` x the lr."""

    # peak learning rate, reached at the end of the warm-up
    lr: float = 3e-4
    # steps of linear warm-up from 0 to lr
    warmup_steps: int = 300
    final_lr_ratio: float = 0.1  # cosine decays to this fraction of lr (the reference's 10%)
    # AdamW's first-moment decay
    b1: float = 0.9
    # AdamW's second-moment decay
    b2: float = 0.95
    # AdamW's epsilon
    eps: float = 1e-8
    # decoupled weight decay (matrices only)
    weight_decay: float = 0.1
    # gradients are clipped to this global norm
    clip_norm: float = 1.0
    # the learned alpha scalars train at this multiple of the learning rate (0: frozen)
    alpha_lr_multiplier: float = 1.0

    def __post_init__(self):
        _require(self.lr > 0, "lr", "must be > 0", self.lr)
        _require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0", self.warmup_steps)
        _require(0 <= self.final_lr_ratio <= 1, "final_lr_ratio", "must lie in [0, 1]", self.final_lr_ratio)
        _require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, "b1/b2", "must lie in [0, 1)", (self.b1, self.b2))
        _require(self.weight_decay >= 0, "weight_decay", "must be >= 0", self.weight_decay)
        _require(self.clip_norm > 0, "clip_norm", "must be > 0", self.clip_norm)
        _require(self.alpha_lr_multiplier >= 0, "alpha_lr_multiplier", "must be >= 0", self.alpha_lr_multiplier)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes; -1 fills with the devices left over (at most one axis may be -1)."""

    # data parallelism: the batch is split over data x fsdp; parameters are replicated along it
    data: int = -1
    # fully sharded data parallelism: splits the batch and each parameter's d_model dimension
    fsdp: int = 1
    # tensor parallelism: splits heads, the MLP hidden dimension and the vocabulary
    tensor: int = 1
    # the first N devices only (0: every device); a one-process job only
    devices: int = 0

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        _require(all(s == -1 or s >= 1 for s in sizes), "data/fsdp/tensor", "axis sizes must be >= 1 or -1", sizes)
        _require(sizes.count(-1) <= 1, "data/fsdp/tensor", "at most one axis may be -1", sizes)
        _require(self.devices >= 0, "devices", "must be >= 0 (0: every device)", self.devices)


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in ``<workdir>/checkpoints/<step>``: train state and data-iterator position."""

    # save every N steps; the last step and a stop (SIGTERM, Ctrl-C) always save too
    every_steps: int = 500
    # keep the newest N finished checkpoints, deleting older ones
    keep: int = 3
    # write in the background while training continues (a failure is reported at the next step)
    async_save: bool = True

    def __post_init__(self):
        _require(self.every_steps >= 1, "every_steps", "must be >= 1", self.every_steps)
        _require(self.keep >= 1, "keep", "must be >= 1", self.keep)


@dataclass(frozen=True)
class EvalConfig:
    """The extrapolation evaluation run at the end of training (and by ``launch.eval``)."""

    # launch.train evaluates the final checkpoint before it exits, writing <workdir>/eval/<step>.json
    at_end: bool = True
    # evaluated lengths as multiples of seq_len (launch.eval --lengths overrides)
    length_multipliers: tuple[int, ...] = (1, 2, 4)
    # validation tokens scored per dataset at every length (cut to a multiple of the longest length)
    max_tokens: int = 65536
    # rows of seq_len tokens per forward pass: eval batches hold batch_size x seq_len tokens at
    # every length (fewer, longer rows beyond 1x)
    batch_size: int = 4
    # validation curves during training: every N steps, the mean NLL at the training length on
    # the first ``curve_tokens`` tokens of each validation source, logged as val/<source> (0: off)
    every_steps: int = 0
    # tokens of each validation source scored for a validation-curve point
    curve_tokens: int = 32768
    # lengths of the validation curve as multiples of seq_len (must include 1): 1 is
    # val/<source>, m > 1 is val_<m>x/<source>, the extrapolation curve against tokens seen
    curve_multipliers: tuple[int, ...] = (1,)
    # tokens of each validation source scored at each curve length beyond 1x (few: a longer
    # window costs more per token, and the curve should stay a small part of a run's time)
    curve_long_tokens: int = 8192

    def __post_init__(self):
        _require(self.every_steps >= 0, "every_steps", "must be >= 0 (0 = no validation curve)", self.every_steps)
        _require(self.curve_tokens >= 1, "curve_tokens", "must be >= 1", self.curve_tokens)
        curve = self.curve_multipliers
        _require(1 in curve and all(isinstance(m, int) and m >= 1 for m in curve), "curve_multipliers", "must be ints >= 1 and include 1", curve)
        _require(len(set(curve)) == len(curve), "curve_multipliers", "must not repeat a length", curve)
        _require(self.curve_long_tokens >= 1, "curve_long_tokens", "must be >= 1", self.curve_long_tokens)
        mults = self.length_multipliers
        _require(len(mults) > 0 and all(m >= 1 for m in mults), "length_multipliers", "must be ints >= 1", mults)
        _require(self.max_tokens >= 1 and self.batch_size >= 1, "max_tokens/batch_size", "must be >= 1", (self.max_tokens, self.batch_size))


@dataclass(frozen=True)
class SSAConfig:
    """Paper B's training: each step runs the full (dense) or the sparse stream with
    probability ``sparse_prob``; every layer also computes the other stream for the alignment
    loss SmoothL1(h_full, sg(h_sparse)) + SmoothL1(sg(h_full), h_sparse), weighted by
    ``align_weight``. The sparse stream is ``model.attention`` with kind=``sparse_kind``:
    block_sparse (MoBA blocks, the paper), offset (Fibonacci offsets: "ssa_fib") or nsa (needs
    ``model.attention.nsa_params=true``: the model's own attention is the dense full stream)."""

    # train with paper B's two streams and alignment loss (model.attention.kind must be dense)
    enabled: bool = False
    # the sparse stream's attention: a registered sparse kind (block_sparse | offset | nsa)
    sparse_kind: str = "block_sparse"
    # weight of the alignment loss added to the cross-entropy
    align_weight: float = 10.0
    # probability that a step runs the sparse stream (else the full one; every layer computes
    # the other stream too, for the alignment loss)
    sparse_prob: float = 0.5

    def __post_init__(self):
        from fibjax.kinds import registry

        names = registry.names()
        _require(self.sparse_kind in names, "sparse_kind", f"must be a registered attention kind: {', '.join(names)}", self.sparse_kind)
        if self.enabled:  # asks the kind itself (which loads JAX): only for a config that trains SSA
            _require(registry.get(self.sparse_kind).sparse, "sparse_kind", "must be a sparse attention kind, not the full stream's", self.sparse_kind)
        _require(self.align_weight >= 0, "align_weight", "must be >= 0", self.align_weight)
        _require(0 <= self.sparse_prob <= 1, "sparse_prob", "must lie in [0, 1]", self.sparse_prob)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; saved as ``<workdir>/config.json``."""

    # the run's name: its default workdir (runs/<name>) and its label in reports
    name: str = "run"
    # seeds the parameter initialisation, the data order and SSA's stream choice
    seed: int = 42
    # optimizer steps in all; may grow when resuming (the cosine schedule then changes)
    steps: int = 1000
    # training length in tokens (evaluation lengths are multiples of it)
    seq_len: int = 256
    # sequences per step over the whole job; must divide by the processes and by data x fsdp
    global_batch: int = 16
    # steps between progress-bar loss updates (metrics.jsonl gets every step) and between the
    # processes' checks for a stop request in a multi-process job
    log_every: int = 10
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ssa: SSAConfig = field(default_factory=SSAConfig)
    # continual training: start from another run's parameters ("RUN_DIR" or "RUN_DIR:STEP";
    # parameters only: a fresh optimizer and data position). See fibjax.train.init_from.
    init_from: str = ""

    def __post_init__(self):
        _require(self.steps >= 1, "steps", "must be >= 1", self.steps)
        if self.ssa.enabled:
            a = self.model.attention
            from fibjax.kinds import registry

            _require(not registry.get(a.kind).sparse, "model.attention.kind", "must be dense (the full stream) when ssa.enabled", a.kind)
            _require(not a.learn_alpha and a.alpha != "learned", "model.attention.alpha", "the ssa sparse stream uses static alphas", a.alpha)
            _require(
                not registry.get(self.ssa.sparse_kind).params_needed or a.nsa_params,
                "model.attention.nsa_params",
                "must be true when ssa.sparse_kind=nsa (the dense full stream then carries NSA's gates and compression)",
                a.nsa_params,
            )
        _require(self.seq_len >= 2, "seq_len", "must be >= 2", self.seq_len)
        _require(self.global_batch >= 1, "global_batch", "must be >= 1", self.global_batch)
        _require(self.log_every >= 1, "log_every", "must be >= 1", self.log_every)

    @property
    def sparse_stream(self) -> AttentionConfig | None:
        """The SSA sparse stream's attention (None unless ssa.enabled)."""
        return dataclasses.replace(self.model.attention, kind=self.ssa.sparse_kind) if self.ssa.enabled else None


# ---------------------------------------------------------------------------------------
# Generic machinery: overrides, dict/JSON round trip, loading config files.


def _coerce(value, tp, path: str):
    """Convert a parsed literal to annotation ``tp`` or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: {value!r} is none of the accepted types {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected None, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise ConfigError(f"{path}: expected a tuple, got {value!r}")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, path) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return from_dict(tp, value, path)
        raise ConfigError(f"{path}: expected a {tp.__name__} mapping, got {value!r}")
    raise ConfigError(f"{path}: unsupported annotation {tp}")


def _parse_literal(text: str):
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string


def from_dict(cls: type[C], data: dict, path: str = "") -> C:
    """Build dataclass ``cls`` from a (nested) dict; unknown keys are errors naming them.

    Args:
        cls: The dataclass (a config section or TrainConfig).
        data: Its fields, sections as nested dicts.
        path: The dotted path of ``data`` in the tree, for messages.

    Returns:
        The instance, validated.

    Raises:
        ConfigError: An unknown key or a value its field refuses, named by its path.
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        hint = _did_you_mean(unknown[0], names, f"{path}." if path else "") if len(unknown) == 1 else ""
        raise ConfigError(f"{path or cls.__name__}: unknown key(s) {unknown}{hint}; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path + '.' if path else ''}{e}") from None


def to_dict(cfg: typing.Any) -> dict:
    """The config as nested dicts (``dataclasses.asdict``): what ``from_dict`` reads back.

    Args:
        cfg: A config dataclass.

    Returns:
        The dict.
    """
    return dataclasses.asdict(cfg)


def apply_overrides(cfg: C, overrides: list[str]) -> C:
    """Apply ``a.b.c=value`` strings; values are Python literals or bare words (strings).

    Every section is rebuilt once with all of its changes, so its checks see them together and
    the order of the words never matters (``rope_scaling=yarn`` before ``rope_original_len=256``
    is fine); a key given twice takes its last value (only that one is parsed and checked). A
    section given whole (``model.attention={...}``) cannot also take field overrides.

    Args:
        cfg: The config (a TrainConfig or a section).
        overrides: The ``key=value`` strings.

    Returns:
        A new config with the overrides applied and checked.

    Raises:
        ConfigError: A word not of the form key=value, an unknown key, a bad value, or a section
            given both whole and by field.
    """
    changes: dict = {}  # field name -> nested dict (a section) or _Leaf
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        *sections, field = key.split(".")
        node = changes
        for i, name in enumerate(sections):
            node = node.setdefault(name, {})
            if isinstance(node, _Leaf):
                raise ConfigError(f"{key}: {'.'.join(sections[: i + 1])!r} is given a value by another override")
        if isinstance(node.get(field), dict):
            raise ConfigError(f"{key}: other overrides set fields inside it")
        node[field] = _Leaf(_parse_literal(text), key)
    return _replace_all(cfg, changes)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    value: object
    full: str  # the override's key as written, for errors


def _replace_all(node, changes: dict, prefix: str = ""):
    """``node`` with every change of ``changes`` (a tree of field names ending in _Leaf values)
    applied in one ``dataclasses.replace``, its sections first. A validation error already names
    the field inside ``node`` ("window: must be >= 0"), so it gets only ``node``'s path in front."""
    names = {f.name for f in dataclasses.fields(node)}
    values = {}
    for head, change in changes.items():
        full = change.full if isinstance(change, _Leaf) else next(_leaves(change)).full
        if head not in names:
            raise ConfigError(f"{full}: unknown key {head!r} in {type(node).__name__}{_did_you_mean(head, names, prefix)}; known: {sorted(names)}")
        if isinstance(change, _Leaf):
            values[head] = _coerce(change.value, typing.get_type_hints(type(node))[head], change.full)
            continue
        child = getattr(node, head)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"{full}: {head!r} is a value, not a section")
        values[head] = _replace_all(child, change, f"{prefix}{head}.")
    try:
        return dataclasses.replace(node, **values)
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}") from None


def _did_you_mean(name: str, names, prefix: str) -> str:
    """``" (did you mean model.window?)"`` for a near miss (a typo), else nothing."""
    close = difflib.get_close_matches(name, sorted(names), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _leaves(changes: dict):
    for change in changes.values():
        yield from _leaves(change) if isinstance(change, dict) else (change,)


# where "configs/..." names resolve when not found from the working directory: a clone's
# configs/ (an editable install), else the copy a wheel ships inside the package (pyproject.toml)
SHIPPED_CONFIGS = (Path(__file__).resolve().parent.parent / "configs", Path(__file__).resolve().parent / "configs")


def find_config_file(path: str | Path) -> Path:
    """``path`` if it is a file; else, for ``configs/X.py``, the config of that name that fibjax
    ships, so that the documented commands work from any directory and from a wheel.

    Args:
        path: The path given (``--config``).

    Returns:
        The file to load.

    Raises:
        ConfigError: No such file, here or among the shipped configs (with a suggestion where one
            fits).
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_absolute() and path.parts[:1] == ("configs",):
        for root in SHIPPED_CONFIGS:
            if (root.joinpath(*path.parts[1:])).is_file():
                return root.joinpath(*path.parts[1:])
    inside = sorted(str(f) for f in path.glob("*.py")) if path.is_dir() else []
    what = f"is a folder, not a config file{f' (it holds {inside[0]}, ...)' if inside else ''}" if path.is_dir() else "does not exist"
    shipped = next((root for root in SHIPPED_CONFIGS if root.is_dir()), None)
    with_py = path.with_name(path.name + ".py") if path.name and path.suffix not in (".py", ".json") else None
    if with_py and _config_exists(with_py):  # configs/tiny for configs/tiny.py
        raise ConfigError(f"config file {str(path)!r} {what}: did you mean --config {with_py}?")
    where = f" (configs/NAME.py also finds the configs shipped with fibjax, in {shipped})" if shipped else ""
    raise ConfigError(f"config file {str(path)!r} {what}{where}")


def _config_exists(path: Path) -> bool:
    try:
        find_config_file(path)
    except ConfigError:
        return False
    return True


def load_config_file(path: str | Path) -> typing.Any:  # noqa: DOC503
    """Import a Python config file and return its ``get_config()``: a config dataclass; or read
    a run's ``config.json`` (a TrainConfig), e.g. to continue an imported model with ``init_from``.

    Anything that goes wrong in the file (a syntax error, a failing import, an exception in
    ``get_config()``, a wrong return value) is one ConfigError naming the file and line.

    Args:
        path: A Python config file or a run's ``config.json``.

    Returns:
        The config dataclass.

    Raises:
        ConfigError: The file cannot be loaded or gives no config.
    """
    path = find_config_file(path)
    if path.suffix == ".json":
        try:
            return from_dict(TrainConfig, json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"config file {str(path)!r} is not a run's config.json: {e}") from None
    spec = importlib.util.spec_from_file_location(f"fibjax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise _config_file_error(path, e) from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {str(path)!r} defines no get_config()")
    try:
        cfg = module.get_config()
    except Exception as e:
        raise _config_file_error(path, e) from None
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise ConfigError(f"config file {str(path)!r}: get_config() returned {cfg!r}, not a config such as a TrainConfig (a missing `return`?)")
    return cfg


def _config_file_error(path: Path, e: Exception) -> ConfigError:
    """``e``, raised while loading the config file ``path``, as one line naming the file and line."""
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename).resolve() == path.resolve():
        return ConfigError(f"config file {str(path)!r}, line {e.lineno}: syntax error: {e.msg}")
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    what = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
    return ConfigError(f"config file {str(path)!r}{f', line {lines[-1]}' if lines else ''}: {what}")
