"""From a run directory to ``RUN/eval/<step>.json``: load, pick datasets, evaluate, print.

A run directory holds ``config.json`` (the resolved TrainConfig) and ``checkpoints/``; its
tokenizer is the one in the run's data directory. Evaluation data must have been tokenized
with that tokenizer (checked by hash).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from fibjax import data as data_lib
from fibjax.attention import offsets
from fibjax.config import AttentionConfig, TrainConfig
from fibjax.data.token_files import TOKENIZER_FILE, open_tokens
from fibjax.data.tokenizer import Tokenizer
from fibjax.eval.perplexity import EvalError, dropped_mass_by_layer, evaluate_lengths
from fibjax.model import theta_to_alpha
from fibjax.train.checkpoint import Checkpointer, load_run_config, pinned_tokenizer
from fibjax.train.loop import resolve_data_dir


@dataclass
class LoadedRun:
    cfg: TrainConfig
    step: int
    params: dict
    data_dir: Path
    tokenizer_sha256: str


def load_run(workdir: str | Path, step_number: int | None = None) -> LoadedRun:
    """The run's config and the parameters of ``step_number`` (default: the latest checkpoint)."""
    workdir = Path(workdir)
    cfg = load_run_config(workdir)
    ckpt = Checkpointer(workdir, cfg.checkpoint)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise EvalError(f"{workdir} has no checkpoint yet")
        chosen = steps[-1] if step_number is None else step_number
        if chosen not in steps:
            raise EvalError(f"{workdir} has no checkpoint for step {chosen}; available: {steps}")
        params = ckpt.restore_params(chosen, abstract_params(cfg.model, jax.devices()[0]))
    finally:
        ckpt.close()
    data_dir = resolve_data_dir(cfg, workdir)
    # the data must still hold the tokenizer the run trained with (load_meta also checks the file)
    sha = data_lib.load_meta(data_dir, tokenizer_sha256=pinned_tokenizer(workdir))["tokenizer"]["sha256"]
    return LoadedRun(cfg, chosen, params, data_dir, sha)


def abstract_params(model_cfg, device) -> dict:
    """ShapeDtypeStructs of the model's parameters, placed on ``device`` (nothing allocated)."""
    from flax import nnx

    from fibjax.model import Transformer

    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))), nnx.Param))
    place = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place), shapes)


def run_tokenizer(run: LoadedRun) -> Tokenizer:
    """The tokenizer the run trained with (``load_run`` checked it against the run's record)."""
    return Tokenizer.load(run.data_dir / TOKENIZER_FILE)


def with_attention(run: LoadedRun, attention: AttentionConfig) -> tuple[dict, object]:
    """(params, model config) for evaluating the run's weights under another attention.

    Weights carry over unchanged; a learned layer's theta is dropped when the override has
    none, and created from the override's schedule when the override learns alpha."""
    from fibjax.attention.offsets import alpha_to_theta

    model_cfg = dataclasses.replace(run.cfg.model, attention=attention)
    alphas = attention.layer_alphas(model_cfg.num_layers) if attention.kind == "offset" else None
    blocks = {}
    for i, block in run.params["blocks"].items():
        attn = {k: v for k, v in block["attn"].items() if k != "theta"}
        if attention.is_learned:
            attn["theta"] = block["attn"].get("theta", np.float32(alpha_to_theta(alphas[i])))
        blocks[i] = {**block, "attn": attn}
    return {**run.params, "blocks": blocks}, model_cfg


def dataset_streams(run: LoadedRun, specs: dict[str, str] | None) -> dict[str, np.ndarray]:
    """Validation token streams by name. ``specs``: name -> prepared DIR or DIR:SOURCE;
    None: every validation source of the run's own data."""
    if not specs:
        meta = data_lib.load_meta(run.data_dir)
        return {name: open_tokens(run.data_dir, meta, name, "val") for name in data_lib.validation_sources(meta)}
    streams = {}
    for name, spec in specs.items():
        directory, _, source = spec.partition(":")
        meta = data_lib.load_meta(directory, tokenizer_sha256=run.tokenizer_sha256)
        source = source or (name if name in meta["sources"] else None)
        if source is None:
            choices = data_lib.validation_sources(meta)
            if len(choices) != 1:
                raise EvalError(f"--data {name}={spec}: name a source with DIR:SOURCE; {directory} has {choices}")
            source = choices[0]
        streams[name] = open_tokens(directory, meta, source, "val")
    return streams


def evaluate_run(run: LoadedRun, *, lengths: list[int], datasets: dict[str, np.ndarray], max_tokens: int, attention: AttentionConfig | None = None,
                 dropped_mass: bool = False) -> dict:
    params, model_cfg = with_attention(run, attention) if attention else (run.params, run.cfg.model)
    rows_tokens = run.cfg.eval.batch_size * run.cfg.seq_len
    results, masses = {}, {}
    for name, stream in datasets.items():
        results[name] = [r.as_dict() for r in evaluate_lengths(model_cfg, params, stream, lengths, max_tokens=max_tokens, rows_tokens=rows_tokens)]
        if dropped_mass:
            masses[name] = {str(n): dropped_mass_by_layer(model_cfg, params, stream, n, max_tokens=max_tokens, rows_tokens=rows_tokens) for n in lengths}
    alphas = layer_alphas(params, model_cfg)
    report = {
        "run": run.cfg.name, "step": run.step, "train_seq_len": run.cfg.seq_len, "lengths": lengths, "max_tokens": max_tokens,
        "num_layers": model_cfg.num_layers, "attention": dataclasses.asdict(model_cfg.attention), "attention_override": attention is not None,
        "alphas": alphas, "alpha_init": initial_alphas(model_cfg), "datasets": results,
        "new_distances": {str(n): new_distances(model_cfg.attention, alphas, run.cfg.seq_len, n) for n in lengths},
    }
    if dropped_mass:
        report["dropped_mass"] = masses  # dataset -> length -> per layer, vs dense attention
    return report


def inference_overrides(cfg: TrainConfig, mode: str | None, *, num_blocks: int | None = None, block_size: int | None = None) -> list[str]:
    """``--inference-mode full|sparse`` and a sparse budget as attention overrides.

    sparse = the run's SSA sparse stream, else its own sparse attention, else (a dense-trained
    run: paper B's "attention gap") MoBA blocks with the config's block budget."""
    out = []
    if mode == "full":
        out.append("kind=dense")
    elif mode == "sparse":
        own = cfg.model.attention.kind
        out.append(f"kind={cfg.ssa.sparse_kind if cfg.ssa.enabled else own if own != 'dense' else 'block_sparse'}")
    elif mode is not None:
        raise EvalError(f"--inference-mode must be full or sparse, got {mode!r}")
    if num_blocks is not None:
        out.append(f"num_blocks={num_blocks}")
    if block_size is not None:
        out.append(f"block_size={block_size}")
    return out


def reachable_distances(acfg: AttentionConfig, alpha: float | None, seq_len: int) -> set[int]:
    """Query-key distances a layer can attend at ``seq_len``: all of them for dense and block-sparse
    (selection is by content), the static set for offsets, and {lo, lo + 1} of each active rung plus
    the window for learned (interpolated) layers at ``alpha``."""
    if acfg.kind != "offset":
        return set(range(seq_len))
    if not acfg.is_learned:
        return set(offsets.attended_distances(window=acfg.window, base=acfg.bounded_base, alpha=alpha, seq_len=seq_len))
    spec = offsets.learned_rung_spec(window=acfg.window, base=acfg.bounded_base, alpha=alpha, seq_len=seq_len)
    far = {d for _, lo, _ in spec for d in (lo, lo + 1) if d <= seq_len - 1}
    return set(range(min(acfg.window, seq_len - 1) + 1)) | far


def new_distances(acfg: AttentionConfig, alphas: list[float | None], train_len: int, length: int) -> list[int]:
    """Per layer: how many distances attended at ``length`` were never attended at ``train_len``
    (with the layer's current alpha). 0 means the layer only meets trained relative positions."""
    return [len(reachable_distances(acfg, a, length) - reachable_distances(acfg, a, train_len)) for a in alphas]


def initial_alphas(model_cfg) -> list[float] | None:
    """A learned run's starting alphas as the model really started them (pulled into
    [0.55, 1.45] by alpha_to_theta); None for a run without learned alpha."""
    from fibjax.attention.offsets import alpha_to_theta

    acfg = model_cfg.attention
    if not acfg.is_learned:
        return None
    return [float(theta_to_alpha(alpha_to_theta(a))) for a in acfg.layer_alphas(model_cfg.num_layers)]


def layer_alphas(params: dict, model_cfg) -> list[float | None]:
    acfg = model_cfg.attention
    if acfg.kind != "offset":
        return [None] * model_cfg.num_layers
    if not acfg.is_learned:
        return list(acfg.layer_alphas(model_cfg.num_layers))
    return [float(theta_to_alpha(params["blocks"][i]["attn"]["theta"])) for i in range(model_cfg.num_layers)]


def evaluate_workdir(workdir: str | Path, *, step_number: int | None = None, lengths: list[int] | None = None,
                     specs: dict[str, str] | None = None, max_tokens: int | None = None,
                     attention_overrides: list[str] | None = None, dropped_mass: bool = False) -> tuple[dict, Path]:
    """The whole evaluation of one run directory; returns the report and where it was written.

    Defaults come from the run's own config: lengths = eval.length_multipliers x seq_len, the
    run's validation sources, eval.max_tokens."""
    from fibjax.config import apply_overrides

    run = load_run(workdir, step_number)
    lengths = list(lengths or [m * run.cfg.seq_len for m in run.cfg.eval.length_multipliers])
    attention = apply_overrides(run.cfg.model.attention, attention_overrides) if attention_overrides else None
    report = evaluate_run(run, lengths=lengths, datasets=dataset_streams(run, specs), max_tokens=max_tokens or run.cfg.eval.max_tokens,
                          attention=attention, dropped_mass=dropped_mass)
    report["data"] = specs or {"(the run's own validation sources)": str(run.data_dir)}
    # one file per evaluation setting, so a later evaluation never replaces the end-of-training one
    parts = [a.replace("=", "_") for a in attention_overrides or []] + sorted(f"data_{k}" for k in specs or {})
    parts += [f"len_{'_'.join(map(str, lengths))}"] if lengths != [m * run.cfg.seq_len for m in run.cfg.eval.length_multipliers] else []
    tag = "-".join(p.replace("/", "_") for p in parts)
    return report, write_report(workdir, report, tag)


def write_report(workdir: str | Path, report: dict, tag: str = "") -> Path:
    out = Path(workdir) / "eval" / f"{report['step']}{'-' + tag if tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


def format_table(report: dict) -> str:
    lines = [f"{report['run']} step {report['step']} (trained at {report['train_seq_len']} tokens)",
             "| dataset | length | tokens | NLL | ppl | change vs first length |", "|---|---:|---:|---:|---:|---:|"]
    for name, rows in report["datasets"].items():
        base = rows[0]["ppl"]
        for r in rows:
            lines.append(f"| {name} | {r['length']} | {r['tokens']} | {r['nll']:.4f} | {r['ppl']:.2f} | {100 * (r['ppl'] / base - 1):+.1f}% |")
    alphas = [a for a in report["alphas"] if a is not None]
    if alphas:
        lines.append("alpha per layer: " + " ".join(f"{a:.3f}" for a in report["alphas"]))
    for length, per_layer in report.get("new_distances", {}).items():
        lines.append(f"distances never attended in training, @ {length}, per layer: " + " ".join(map(str, per_layer)))
    for name, by_length in report.get("dropped_mass", {}).items():
        for length, per_layer in by_length.items():
            lines.append(f"dropped mass vs dense, {name} @ {length}: " + " ".join(f"{m:.3f}" for m in per_layer) + f" (mean {np.mean(per_layer):.3f})")
    return "\n".join(lines)
