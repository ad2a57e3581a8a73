"""One probe cell: a condition at a depth, trained on one task with the library's own model and
train step, then scored by distance. The probe is a data source and a loss head: batches are
``{"inputs", "targets", "weights"}`` dicts (``fibjax.train.step.split_batch``), so the loss is
read only at the query (retrieval) or at the positions that can copy (marked).

A cell writes one JSON (its spec, the loss and every layer's alpha during training, accuracy by
distance, and where each layer's rungs sit against the trained distances at the start and end).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from flax import nnx

from fibjax import sharding
from fibjax.attention import alpha as alpha_lib
from fibjax.attention.offsets import attended_distances
from fibjax.config import AttentionConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from fibjax.probe import geometry, soft_width
from fibjax.probe.tasks import (
    Band,
    DistanceSampler,
    ProbeError,
    Vocab,
    forced_choice_correct,
    marked_batch,
    marked_correct,
    max_retrieval_distance,
    retrieval_batch,
)
from fibjax.train import step

# name -> AttentionConfig fields (plus the probe's window): the paper's probe conditions
CONDITIONS: dict[str, dict] = {
    "dense": {"kind": "dense"},
    "pow2_fixed": {"kind": "offset", "base": "pow2", "alpha": "fixed"},
    "fib_fixed": {"kind": "offset", "alpha": "fixed"},
    "fib_stagger": {"kind": "offset", "alpha": "staggered"},
    "fib_learned": {"kind": "offset", "alpha": "learned"},
    "fib_learned_stagger": {"kind": "offset", "alpha": "staggered", "learn_alpha": True},
    # a sliding window with as many keys as fib_fixed attends at the probe's length (issue 51: what
    # do the rungs retrieve that a window of equal cost cannot?)
    "window_equal": {"kind": "window"},
}
# conditions whose window is the key count of fib_fixed at (window, seq_len), not the probe's window
EQUAL_COST = ("window_equal",)
TASKS = ("retrieval", "marked")
_EVAL_STREAM = 1_000_003  # the evaluation's generators never meet a training step's


@dataclass(frozen=True)
class CellSpec:
    """Everything one cell depends on; saved in its JSON."""

    experiment: str
    task: str
    condition: str
    depth: int
    # retrieval: training distances as (lo, hi) bands, one drawn per step; marked: (d1, d2)
    bands: tuple[tuple[int, int], ...] = ()
    marked_distances: tuple[int, ...] = ()
    # retrieval: accuracy read at these distances (empty: every distance 1..T-2)
    eval_distances: tuple[int, ...] = ()
    seq_len: int = 128
    window: int = 8
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    steps: int = 1000
    batch: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    alpha_lr_multiplier: float = 1.0
    n_distract: int = 4
    vocab: Vocab = field(default_factory=Vocab)
    payload_vocab: int = 64
    eval_examples: int = 64  # retrieval: sequences per distance; marked: sequences in all
    log_every: int = 10
    seed: int = 0
    # > 0: train with the soft-width relaxation (``soft_width``), bumps annealed from this width
    # to 0.5; learned conditions only. Scoring always uses the model's own (hard) path.
    soft_width: float = 0.0

    def __post_init__(self):
        if self.task not in TASKS:
            raise ProbeError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.condition not in CONDITIONS:
            raise ProbeError(f"condition must be one of {sorted(CONDITIONS)}, got {self.condition!r}")
        if self.task == "retrieval":
            top = max_retrieval_distance(self.seq_len)
            if not self.bands or max(hi for _, hi in self.bands) > top:
                raise ProbeError(f"retrieval needs training bands within 1..{top}, got {self.bands}")
            if any(not 1 <= d <= top for d in self.eval_distances):
                raise ProbeError(f"eval distances must lie in 1..{top}, got {self.eval_distances}")
        elif len(self.marked_distances) != 2:
            raise ProbeError(f"the marked task needs two distances, got {self.marked_distances}")
        if self.soft_width > 0 and not self.attention().is_learned:
            raise ProbeError(f"soft_width applies to learned alpha only, not to {self.condition!r}")

    @property
    def name(self) -> str:
        return f"{self.condition}_L{self.depth}"

    @property
    def vocab_size(self) -> int:
        return self.vocab.size if self.task == "retrieval" else 2 * self.payload_vocab

    def sampler(self) -> DistanceSampler:
        return DistanceSampler(tuple(Band(lo, hi) for lo, hi in self.bands))

    def target_bands(self) -> list[Band]:
        """The trained distances as bands: what a learned layer is rewarded for reaching."""
        return [Band(lo, hi) for lo, hi in self.bands] if self.task == "retrieval" else [Band(d, d) for d in self.marked_distances]

    def read_distances(self) -> list[int]:
        if self.task == "marked":
            return list(self.marked_distances)
        return list(self.eval_distances) or list(range(1, max_retrieval_distance(self.seq_len) + 1))

    def attention(self) -> AttentionConfig:
        window = self.window
        if self.condition in EQUAL_COST:  # fib_fixed's keys per query: the window {0..W} and the rungs below T
            window = len(attended_distances(window=self.window, base="fibonacci", alpha=1.0, seq_len=self.seq_len))
        return AttentionConfig(window=window, **CONDITIONS[self.condition])

    def train_config(self) -> TrainConfig:
        model = ModelConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            num_layers=self.depth,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            attention=self.attention(),
        )
        optim = OptimConfig(lr=self.lr, warmup_steps=self.warmup_steps, alpha_lr_multiplier=self.alpha_lr_multiplier)
        return TrainConfig(
            name=f"probe_{self.experiment}_{self.name}",
            seed=self.seed,
            steps=self.steps,
            seq_len=self.seq_len,
            global_batch=self.batch,
            log_every=self.log_every,
            model=model,
            optim=optim,
            mesh=MeshConfig(data=1),
        )

    def train_batch(self, step_index: int) -> dict[str, np.ndarray]:
        """Step s's batch: a function of (seed, s) only."""
        rng = np.random.default_rng((self.seed, step_index))
        if self.task == "retrieval":
            d = self.sampler().draw(rng)
            return retrieval_batch(rng, self.batch, self.seq_len, d, self.n_distract, self.vocab).as_train_batch()
        return marked_batch(rng, self.batch, self.seq_len, tuple(self.marked_distances), self.payload_vocab).as_train_batch()


def layer_alphas(params, attention: AttentionConfig, depth: int) -> list[float]:
    """Every layer's alpha (``fibjax.attention.alpha.layer_alphas``); [] for kinds without alpha."""
    return alpha_lib.layer_alphas(params, attention, depth) if attention.has_alpha else []


def _geometry(spec: CellSpec, alphas: list[float]) -> dict:
    attention = spec.attention()
    if not attention.has_alpha:
        return {}
    sets = geometry.layer_distances(attention, spec.depth, spec.seq_len, alphas)
    return {
        "alphas": alphas,
        "rung_distances": [[d for d in s if d > spec.window] for s in sets],
        "bands": [
            {
                "band": [b.lo, b.hi],
                "layers": geometry.distance_table(b, attention, spec.depth, spec.seq_len, alphas),
                "stack_reaches": sorted(set(b.distances()) & geometry.stack_reach(sets, spec.seq_len)),
            }
            for b in spec.target_bands()
        ],
    }


def evaluate(spec: CellSpec, forward: Callable, params) -> dict:
    """Accuracy by distance on fresh sequences (generators apart from training's)."""
    if spec.task == "marked":
        rng = np.random.default_rng((spec.seed, _EVAL_STREAM))
        counts = {d: [0, 0] for d in spec.marked_distances}
        for start in range(0, spec.eval_examples, spec.batch):
            b = marked_batch(rng, min(spec.batch, spec.eval_examples - start), spec.seq_len, tuple(spec.marked_distances), spec.payload_vocab)
            pred = np.asarray(forward(params, b.inputs)).argmax(-1)
            for d, (hit, n) in marked_correct(pred, b).items():
                counts[d][0] += hit
                counts[d][1] += n
        return {
            "distances": list(spec.marked_distances),
            "accuracy": [h / max(n, 1) for h, n in counts.values()],
            "positions": [n for _, n in counts.values()],
            "chance": 1 / spec.vocab_size,
        }
    accuracy = []
    for d in spec.read_distances():
        rng = np.random.default_rng((spec.seed, _EVAL_STREAM, d))
        b = retrieval_batch(rng, spec.eval_examples, spec.seq_len, d, spec.n_distract, spec.vocab)
        logits = np.asarray(forward(params, b.inputs)[:, -1])
        accuracy.append(float(forced_choice_correct(logits, b.choices, b.target).mean()))
    return {"distances": spec.read_distances(), "accuracy": accuracy, "examples": spec.eval_examples, "chance": 1 / (1 + spec.n_distract)}


def run_cell(spec: CellSpec, log: Callable[[str], None] = print) -> dict:
    """Train the cell's model, score it, and return the cell's record (JSON-ready)."""
    cfg = spec.train_config()
    attention = cfg.model.attention
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    trainer = step.build(cfg, mesh)
    forward = jax.jit(lambda params, x: nnx.merge(trainer.graphdef, params)(x))
    if spec.soft_width > 0:
        relaxed = soft_width.make_step(trainer)
        train = lambda state, batch, s: relaxed(state, batch, np.float32(soft_width.width_at(s, spec.steps, spec.soft_width)))
    else:
        train = lambda state, batch, s: trainer.step(state, batch)
    start = time.perf_counter()
    loss_steps, losses, alpha_steps, alphas, window_losses = [], [], [], [], []
    with jax.set_mesh(mesh):
        state = trainer.init()
        alpha_init = layer_alphas(state["params"], attention, spec.depth)
        if attention.is_learned:
            alpha_steps.append(0)
            alphas.append(alpha_init)

        def record(s: int, metrics: dict) -> None:  # s = steps done
            window_losses.append(float(metrics["loss"]))
            if s % spec.log_every == 0 or s == spec.steps:
                loss_steps.append(s)
                losses.append(float(np.mean(window_losses)))
                window_losses.clear()
                if metrics["alphas"]:
                    alpha_steps.append(s)
                    alphas.append([float(metrics["alphas"][f"layer_{i}"]) for i in range(spec.depth)])
            if s % max(spec.steps // 5, 1) == 0 and losses:
                log(
                    f"  {spec.experiment}/{spec.name}: step {s}/{spec.steps} loss {losses[-1]:.3f}"
                    + (f" alphas {np.round(alphas[-1], 3).tolist()}" if alphas else "")
                )

        pending = None
        for s in range(spec.steps):
            batch = jax.device_put(spec.train_batch(s), trainer.batch_sharding)
            state, metrics = train(state, batch, s)
            if pending is not None:  # read step s's metrics after step s+1 is dispatched
                record(s, jax.device_get(pending))
            pending = metrics
        record(spec.steps, jax.device_get(pending))
        train_s = time.perf_counter() - start
        if not np.isfinite(losses[-1]):
            raise FloatingPointError(f"{spec.experiment}/{spec.name}: loss is {losses[-1]} at the end of training")
        accuracy = evaluate(spec, forward, state["params"])
    alpha_final = layer_alphas(state["params"], attention, spec.depth)
    return {
        "experiment": spec.experiment,
        "task": spec.task,
        "condition": spec.condition,
        "depth": spec.depth,
        "name": spec.name,
        "spec": dataclasses.asdict(spec),
        "attention": dataclasses.asdict(attention),
        "learned": attention.is_learned,
        "params": int(sum(x.size for x in jax.tree.leaves(state["params"]))),
        "train_distances": spec.sampler().support() if spec.task == "retrieval" else list(spec.marked_distances),
        "bands": [[b.lo, b.hi] for b in spec.target_bands()],
        "alpha_init": alpha_init,
        "alpha_final": alpha_final,
        "alpha_trajectory": {"steps": alpha_steps, "alphas": alphas},
        "loss_trajectory": {"steps": loss_steps, "loss": losses},
        "accuracy": accuracy,
        "geometry": {"init": _geometry(spec, alpha_init), "final": _geometry(spec, alpha_final)},
        "seconds": {"train": train_s, "total": time.perf_counter() - start},
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
