"""``python -m launch.bench attention``: every attention path, forward and forward+backward.

Paths are registered in ``PATHS`` (name -> builder); each builder gets the case and returns
``f(q, k, v, alpha) -> out``. alpha is an argument of the timed program, as it is in training
(traced from its logit): a closed-over constant would let XLA fold the learned path's rung shifts
into static ones. fwd+bwd differentiates q, k, v and alpha. Ratios are computed from timings
taken in the same process.

``static``/``learned`` are the XLA paths, ``*_pallas`` the Pallas kernels (``block_sparse_pallas``:
forward, dq and dk/dv kernels; ``block_sizes.block_k`` is its pairs per dk/dv program) (interpret mode on
CPU: correct but slow, and saying nothing about GPU speed, so they run on CPU only when named
in ``--paths``), ``cudnn`` is ``jax.nn.dot_product_attention(implementation="cudnn")``, causal
and dense (GPU, 16-bit dtypes only). ``torch_sdpa`` is PyTorch's fused causal
``scaled_dot_product_attention`` on the same inputs, timed by torch (the row appears when torch is
installed: ``pip install torch``); ``dense / torch_sdpa`` is the dense XLA path's distance from it. GB/s and TFLOP/s are the compulsory HBM traffic and
the useful arithmetic of ``roofline`` over the time, and ``/ ref`` the time over the dense
reference row's (cuDNN on a GPU, else the XLA dense path).
``block_sparse_pallas:VARIANT`` is that row with the kernels' variant VARIANT (a name of
``block_kernels.VARIANTS``: the same attention done another way, issue 53); each such row is
also printed over the plain ``block_sparse_pallas`` row (``launch.bench attention
--pallas-variants``). ``window`` is the sliding-window kind's XLA path (``fibjax.attention.window``) and ``cudnn_window``
cuDNN's sliding window (``local_window_size``; GPU, 16-bit), both over ``Case.window_keys``: as many
keys per query as the static offset rows attend, so ``static / window`` compares the two at equal
keys per query. ``--cpu-devices N`` (``cpu_head_mesh``) runs the JAX paths on N CPU devices, each computing its
share of the heads (``_per_head_shard``): XLA:CPU gives each device a thread of its own, which
uses a machine's cores better than the threads within one device (BUILD_NOTES, "Dense").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fibjax import attention
from fibjax.attention.pallas import BlockSizes, interpolated_attention_pallas, offset_attention_pallas
from fibjax.attention.pallas.block_kernels import VARIANTS, BlockKernelOptions
from fibjax.attention.pallas.block_ops import block_sparse_attention_pallas
from fibjax.attention.sharded import HEAD_AXIS
from fibjax.attention.window import cudnn_window, window_attention
from fibjax.bench import roofline, torch_sdpa
from fibjax.bench.timing import Measurement, Timer, ratio


@dataclass(frozen=True)
class Case:
    seq_len: int
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    window: int = 12
    num_layers: int = 16  # the static/learned alpha is the staggered alpha of the middle layer
    block_sizes: BlockSizes = BlockSizes()  # the Pallas rows'
    sparse_block: int = 16  # block_sparse row: paper B's 16 blocks of 16 (receptive field 256)
    sparse_blocks: int = 16
    nsa_window: int = 127  # nsa row: paper B's NSA baseline, the same blocks + a window of 128 keys

    @property
    def alpha(self) -> float:
        return attention.alpha_schedule("staggered", self.num_layers)[self.num_layers // 2]

    @property
    def distances(self) -> tuple[int, ...]:
        """The static rows' attended distances: the window and the Fibonacci rungs at ``alpha``."""
        return attention.attended_distances(window=self.window, base="fibonacci", alpha=self.alpha, seq_len=self.seq_len)

    @property
    def window_keys(self) -> int:
        """The window rows' W: the keys per query of the static rows (a query past the last rung)."""
        return len(self.distances)


def _dense(case: Case) -> Callable:
    return lambda q, k, v, alpha: attention.dense_attention(q, k, v)


def _static(case: Case) -> Callable:
    return lambda q, k, v, alpha: attention.offset_attention(q, k, v, distances=case.distances, implementation="xla")


def _learned(case: Case) -> Callable:
    return lambda q, k, v, alpha: attention.interpolated_attention(q, k, v, window=case.window, base="fibonacci", alpha=alpha, implementation="xla")


def _static_pallas(case: Case) -> Callable:
    return lambda q, k, v, alpha: offset_attention_pallas(q, k, v, distances=case.distances, block_sizes=case.block_sizes)


def _learned_pallas(case: Case) -> Callable:
    return lambda q, k, v, alpha: interpolated_attention_pallas(q, k, v, window=case.window, base="fibonacci", alpha=alpha, block_sizes=case.block_sizes)


def _block_sparse_pallas(case: Case, options: BlockKernelOptions | None = None) -> Callable:
    blocks = dict(block_size=case.sparse_block, num_blocks=case.sparse_blocks)
    return lambda q, k, v, alpha: block_sparse_attention_pallas(q, k, v, **blocks, block_sizes=case.block_sizes, options=options)


def _window(case: Case) -> Callable:
    return lambda q, k, v, alpha: window_attention(q, k, v, window=case.window_keys, implementation="xla")


def _cudnn_window(case: Case) -> Callable:
    _need_gpu_16bit(case, "cudnn_window")
    return lambda q, k, v, alpha: cudnn_window(q, k, v, case.window_keys)


def _cudnn(case: Case) -> Callable:
    _need_gpu_16bit(case, "cudnn")
    return lambda q, k, v, alpha: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=True)


def _need_gpu_16bit(case: Case, what: str) -> None:
    if jax.default_backend() != "gpu" or case.dtype not in ("bfloat16", "float16"):
        raise Unavailable(f"{what} needs a GPU and a 16-bit dtype")


def _triton_flash(case: Case) -> Callable:
    """JAX's own dense causal flash attention on Pallas' Triton backend: what that backend reaches
    on this GPU for plain tiles (the backend decision, BUILD_NOTES "Backend and pin")."""
    _need_gpu_16bit(case, "triton_flash")
    if case.kv_heads != case.heads:
        raise Unavailable("triton_flash has no grouped KV heads")
    from jax.experimental.pallas.ops.gpu import attention as triton_attention

    return lambda q, k, v, alpha: triton_attention.mha(q, k, v, None, sm_scale=case.head_dim**-0.5, causal=True)


def _mosaic_flash(case: Case) -> Callable:
    """The same on Mosaic GPU (``attention_mgpu``: warpgroup matrix multiplies, Hopper only; no causal
    backward yet, so forward only: ``FORWARD_ONLY``)."""
    _need_gpu_16bit(case, "mosaic_flash")
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    return lambda q, k, v, alpha: attention_mgpu.attention(q, k, v, config)


class Unavailable(Exception):
    """A path that cannot run for this case on this machine (its row is left out)."""


def _learned_frozen(case: Case) -> Callable:
    """The learned path after training: alpha a Python float, compiled as a constant."""
    alpha = float(case.alpha)
    return lambda q, k, v, _: attention.interpolated_attention(q, k, v, window=case.window, base="fibonacci", alpha=alpha, implementation="xla")


def _block_sparse(case: Case) -> Callable:
    return lambda q, k, v, alpha: attention.block_sparse_attention(q, k, v, block_size=case.sparse_block, num_blocks=case.sparse_blocks)


def _nsa(case: Case) -> Callable:
    """The three branches with the model's compression of k and v (gates fixed at 1/2: the gate
    projection is a [D, 3H] matmul of the model, not of the attention)."""
    j, d = case.sparse_block, case.head_dim
    ks = jax.random.split(jax.random.PRNGKey(1), 2)
    w_in, w_out = jax.random.normal(ks[0], (j * d, d)) * (j * d) ** -0.5, jax.random.normal(ks[1], (d, d)) * d**-0.5
    pos = jnp.zeros((j, d))

    def f(q, k, v, alpha):
        w = [x.astype(k.dtype) for x in (pos, w_in, w_out)]
        gates = jnp.full((*q.shape[:3], 3), 0.5, jnp.float32)
        return attention.nsa_attention(
            q,
            k,
            v,
            attention.compress_blocks(k, *w),
            attention.compress_blocks(v, *w),
            gates,
            block_size=j,
            num_blocks=case.sparse_blocks,
            window=case.nsa_window,
        )

    return f


PATHS: dict[str, Callable[[Case], Callable]] = {
    "dense": _dense,
    "static": _static,
    "learned": _learned,
    "learned_frozen": _learned_frozen,
    "block_sparse": _block_sparse,
    "nsa": _nsa,
    "window": _window,
    "static_pallas": _static_pallas,
    "learned_pallas": _learned_pallas,
    "block_sparse_pallas": _block_sparse_pallas,
    "cudnn": _cudnn,
    "cudnn_window": _cudnn_window,
    "triton_flash": _triton_flash,
    "mosaic_flash": _mosaic_flash,
}
FORWARD_ONLY = frozenset({"mosaic_flash"})
VARIANT_PATH = "block_sparse_pallas"  # the path whose kernels come in variants: "block_sparse_pallas:gather"


def split_variant(name: str) -> tuple[str, str | None]:
    """("block_sparse_pallas", "gather") of "block_sparse_pallas:gather"; (name, None) of a plain path."""
    base, _, variant = name.partition(":")
    return base, variant or None


def builder(name: str) -> Callable[[Case], Callable]:
    """The builder of a path of ``PATHS`` or of a variant row ``block_sparse_pallas:VARIANT``."""
    base, variant = split_variant(name)
    if variant is None:
        return PATHS[name]
    if base != VARIANT_PATH or variant not in VARIANTS:
        raise KeyError(f"{name!r}: variants are {VARIANT_PATH}:NAME with NAME one of {list(VARIANTS)}")
    return lambda case: _block_sparse_pallas(case, VARIANTS[variant])


def known(name: str) -> bool:
    try:
        return name in EXTERNAL or bool(builder(name))
    except KeyError:
        return False


def with_variants(paths: list[str], variants: list[str]) -> list[str]:
    """``paths`` with the ``block_sparse_pallas`` row replaced by one row per kernel variant (the
    plain name for "default"), or those rows added at the end."""
    rows = [VARIANT_PATH if v == "default" else f"{VARIANT_PATH}:{v}" for v in variants]
    if VARIANT_PATH not in paths:
        return [*paths, *rows]
    at = paths.index(VARIANT_PATH)
    return [*paths[:at], *rows, *paths[at + 1 :]]


# paths timed outside JAX: name -> (available(), measure(q, k, v, repeats) -> {mode: Measurement})
EXTERNAL = {"torch_sdpa": (torch_sdpa.available, torch_sdpa.timers)}
# (numerator, denominator) pairs printed as ratios of times; issue 8's GPU targets:
# static_pallas / cudnn <= 0.2 (5x faster) and learned_pallas / static_pallas <= 1.5, fwd+bwd
RATIOS: list[tuple[str, str]] = [
    ("static", "dense"),
    ("dense", "torch_sdpa"),
    ("learned", "static"),
    ("learned_frozen", "static"),
    ("block_sparse", "dense"),
    ("nsa", "block_sparse"),
    ("static_pallas", "static"),
    ("learned_pallas", "learned"),
    ("learned_pallas", "static_pallas"),
    ("static_pallas", "cudnn"),
    ("learned_pallas", "cudnn"),
    ("block_sparse_pallas", "block_sparse"),
    ("block_sparse", "cudnn"),
    ("block_sparse_pallas", "cudnn"),
    ("triton_flash", "cudnn"),
    ("mosaic_flash", "cudnn"),
    ("static", "window"),  # the offset and window paths at equal keys per query (Case.window_keys)
    ("static", "cudnn_window"),
    ("static_pallas", "cudnn_window"),
    ("window", "cudnn_window"),
    ("static_pallas", "dense"),  # on TPU, dense is JAX's Pallas flash attention (fibjax/attention/fused.py)
]


def default_paths() -> list[str]:
    """Every path that is fast enough to run here: on CPU the Pallas rows are interpret mode."""
    external = [name for name, (available, _) in EXTERNAL.items() if available()]
    if jax.default_backend() == "cpu":
        return ["dense", "static", "learned", "learned_frozen", "block_sparse", "nsa", *external]
    return [*PATHS, *external]


def cpu_head_mesh(devices: int) -> jax.sharding.Mesh:
    """A mesh of ``devices`` CPU devices along the tensor (head) axis. Must run before anything
    starts JAX's backend (``jax_num_cpu_devices`` is read once, when the CPU client is made)."""
    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError as e:  # the backend is already up with its own count
        raise RuntimeError(f"cannot make {devices} CPU devices: JAX's backend started first ({e})") from None
    if jax.default_backend() != "cpu" or len(jax.devices()) != devices:
        raise RuntimeError(f"--cpu-devices {devices} needs the CPU backend; got {jax.default_backend()} with {len(jax.devices())} devices")
    return jax.make_mesh((devices,), (HEAD_AXIS,))


def _per_head_shard(f: Callable, mesh: jax.sharding.Mesh) -> Callable:
    """``f`` on each device's KV heads and their query heads (attention is independent per head)."""
    heads = P(None, None, HEAD_AXIS, None)
    return jax.shard_map(f, mesh=mesh, in_specs=(heads, heads, heads, P()), out_specs=heads, check_vma=False)


def inputs(case: Case, mesh: jax.sharding.Mesh | None = None):
    """q, k, v of the case; with ``mesh``, their heads split over its tensor axis."""
    if mesh is not None:
        if case.kv_heads % mesh.size:
            raise ValueError(f"{mesh.size} devices do not divide the {case.kv_heads} KV heads")
        heads = jax.sharding.NamedSharding(mesh, P(None, None, HEAD_AXIS, None))
        return tuple(jax.device_put(x, heads) for x in inputs(case))
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    dt = jnp.dtype(case.dtype)
    return (
        jax.random.normal(kq, (case.batch, case.seq_len, case.heads, case.head_dim), dt),
        jax.random.normal(kk, (case.batch, case.seq_len, case.kv_heads, case.head_dim), dt),
        jax.random.normal(kv, (case.batch, case.seq_len, case.kv_heads, case.head_dim), dt),
    )


def forward_backward(f: Callable) -> Callable:
    def loss(q, k, v, alpha):
        return jnp.sum(f(q, k, v, alpha).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2, 3))


def run(
    case: Case, paths: list[str], repeats: int, progress: Callable[[str], None] = lambda _: None, rounds: int = 1, mesh: jax.sharding.Mesh | None = None
) -> dict[tuple[str, str], Measurement]:
    """Measure every path in ``paths`` for one case: {(path, "fwd"|"fwd+bwd"): Measurement};
    ``progress`` hears one line per path after the last round. The paths are compiled (warmed
    up) once and timed in turn, ``rounds`` times, and each reports the median of its rounds'
    medians; a ratio of two of them is the median of the per-round ratios (``timing.ratio``), so
    a load that comes and goes falls on both alike.
    External paths (``torch_sdpa``) join the same rounds. With ``mesh`` (``cpu_head_mesh``) the
    JAX paths run per head shard, one shard a device."""
    q, k, v = inputs(case, mesh)
    alpha = jnp.float32(case.alpha)
    results, timers = {}, {}
    for name in paths:
        if name in EXTERNAL:
            available, external_timers = EXTERNAL[name]
            if not available():
                progress(f"seq {case.seq_len} {name}: skipped (not installed)")
                continue
            timers.update({(name, mode): t for mode, t in external_timers(q, k, v).items()})
            continue
        try:
            f = builder(name)(case)
            if mesh is not None:
                if name.endswith("_pallas"):
                    raise Unavailable("--cpu-devices times the XLA paths only")
                f = _per_head_shard(f, mesh)
        except Unavailable as e:
            progress(f"seq {case.seq_len} {name}: skipped ({e})")
            continue
        programs = {"fwd": f} if name in FORWARD_ONLY else {"fwd": f, "fwd+bwd": forward_backward(f)}
        for mode, program in programs.items():
            try:
                timers[(name, mode)] = Timer(program, q, k, v, alpha)
            except Exception as e:  # on a device, one path that does not compile must not cost the others' rows
                progress(f"seq {case.seq_len} {name} {mode}: FAILED {type(e).__name__}: {str(e)[:1000]}")
    rounds_ms, order = {key: [] for key in timers}, list(timers)
    for r in range(rounds if order else 0):  # each round starts one path later, so no path always follows the same one
        for key in order[r % len(order) :] + order[: r % len(order)]:
            rounds_ms[key].append(timers[key].times(repeats))
    for key, timer in timers.items():
        results[key] = timer.measurement(rounds_ms[key])
    for name, mode in timers:
        progress(f"seq {case.seq_len} {name} {mode}: {results[(name, mode)].ms:.1f} ms")
    return {key: results[key] for key in sorted(results, key=lambda kv: paths.index(kv[0]))}


def reference(res: dict) -> str | None:
    """The dense row every path is divided by: cuDNN where it ran (a GPU), else the XLA dense path."""
    return next((name for name in ("cudnn", "dense") if (name, "fwd") in res), None)


def table(rows: list[tuple[Case, dict]]) -> str:
    """Per path: times, achieved GB/s and TFLOP/s (``roofline``), its time over the reference row's
    (``reference``) and XLA's peak memory; then the ratios of ``RATIOS``."""
    modes = ("fwd", "fwd+bwd")
    head = [f"{m} {col}" for col in ("ms", "GB/s", "TFLOP/s", "/ ref") for m in modes]
    lines = ["| seq | path | " + " | ".join(head) + " | fwd peak MB | fwd+bwd peak MB |", "|---:|---|" + "---:|" * (len(head) + 2)]
    for case, res in rows:
        ref = reference(res)
        for name in dict.fromkeys(n for n, _ in res):
            got = {m: res.get((name, m)) for m in modes}
            ms = [f"{got[m].ms:.3f}" if got[m] else "-" for m in modes]
            rates = {m: roofline.achieved(case, split_variant(name)[0], m, got[m].ms) if got[m] else None for m in modes}
            gbs = [f"{rates[m][0]:.3g}" if rates[m] else "-" for m in modes]
            tfs = [f"{rates[m][1]:.3g}" if rates[m] else "-" for m in modes]
            rel = [f"{ratio(got[m], res[(ref, m)]):.3f}" if got[m] and (ref, m) in res else "-" for m in modes]
            peaks = [f"{got[m].peak_mb:.0f}" if got[m] else "-" for m in modes]
            lines.append(f"| {case.seq_len} | {name} | " + " | ".join([*ms, *gbs, *tfs, *rel, *peaks]) + " |")
    refs = sorted({ref for _, res in rows if (ref := reference(res))})
    lines += ["", f"/ ref: over {' and '.join(refs) or 'nothing (no dense row)'}", "", "| seq | ratio | fwd | fwd+bwd |", "|---:|---|---:|---:|"]
    for case, res in rows:
        variants = [(name, VARIANT_PATH) for name in dict.fromkeys(n for n, _ in res) if split_variant(name)[1]]
        for num, den in [*RATIOS, *variants]:
            r = [f"{ratio(res[(num, m)], res[(den, m)]):.3f}" if (num, m) in res and (den, m) in res else "-" for m in modes]
            if r != ["-", "-"]:
                lines.append(f"| {case.seq_len} | {num} / {den} | {r[0]} | {r[1]} |")
    return "\n".join(lines)
