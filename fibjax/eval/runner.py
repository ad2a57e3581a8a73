"""From a run directory to ``RUN/eval/<step>.json``: load, pick datasets, evaluate, print.

The run is loaded by ``fibjax.run.load`` (its config, a checkpoint's parameters, its data
directory and tokenizer). Evaluation data must have been tokenized with the run's tokenizer
(checked by hash). A non-finite NLL is an error, never a result: nothing is written, and a
report file is replaced atomically, so a good one is never lost to a bad one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

import jax
import numpy as np

from fibjax import data as data_lib
from fibjax import distributed, kinds
from fibjax._moved import forward_to
from fibjax.attention import alpha as alpha_lib
from fibjax.config import AttentionConfig, ConfigError, TrainConfig, apply_overrides
from fibjax.data.token_files import free_space, human_bytes, open_tokens, tokenizer_path, verify_checksums
from fibjax.eval import batching
from fibjax.eval.error_law import error_law
from fibjax.eval.perplexity import EvalError, dropped_mass_by_layer, evaluate_lengths
from fibjax.run import load as run_load
from fibjax.run.failures import disk_full
from fibjax.run.workdir import IMPORTED_FILE

# why ``--dropped-mass`` reports no error law for an attention that is not one softmax
NO_LAW = (
    "{kind}'s output is not one softmax over a subset of the causal keys (NSA mixes three gated branches), "
    "so the law's bound does not apply; the dropped mass is that of the softmax its layer reports (NSA: its selected blocks)"
)

# loading a run moved to fibjax.run.load; the old names still work here, with a DeprecationWarning
__getattr__ = forward_to(__name__, "fibjax.run.load", names=frozenset({"LoadedRun", "abstract_params", "load_run", "run_tokenizer", "with_attention"}))


class ReportNotWritten(EvalError):
    """The evaluation ran but its report file could not be written; ``report`` holds the results
    (print them before the error)."""

    def __init__(self, message: str, report: dict):
        """The error, with the results kept as ``.report``.

        Args:
            message: Why the report could not be written.
            report: The evaluation's report.
        """
        super().__init__(message)
        self.report = report


def dataset_streams(run: run_load.LoadedRun, specs: dict[str, str] | None) -> dict[str, np.ndarray]:
    """Validation token streams by name. ``specs``: name -> prepared DIR or DIR:SOURCE;
    None: every validation source of the run's own data."""
    if not specs:
        meta = data_lib.load_meta(run.data_dir)
        return {name: open_tokens(run.data_dir, meta, name, "val") for name in data_lib.validation_sources(meta)}
    streams = {}
    for name, spec in specs.items():
        directory, _, source = spec.partition(":")
        meta = data_lib.load_meta(directory, tokenizer_sha256=run.tokenizer_sha256)
        verify_checksums(directory, meta)
        source = source or (name if name in meta["sources"] else None)
        if source is None:
            choices = data_lib.validation_sources(meta)
            if len(choices) != 1:
                raise EvalError(f"--data {name}={spec}: name a source with DIR:SOURCE; {directory} has {choices}")
            source = choices[0]
        streams[name] = open_tokens(directory, meta, source, "val")
    return streams


def evaluate_run(  # noqa: DOC502
    run: run_load.LoadedRun,
    *,
    lengths: list[int],
    datasets: dict[str, np.ndarray],
    max_tokens: int,
    attention: AttentionConfig | None = None,
    dropped_mass: bool = False,
) -> dict:
    """Evaluate a loaded run: perplexity of each dataset at each length (and, with ``dropped_mass``,
    each layer's dropped mass against dense attention and paper B's error law where it applies).

    Args:
        run: The loaded run.
        lengths: The evaluation lengths.
        datasets: {name: validation tokens}.
        max_tokens: The most tokens scored at each length.
        attention: Evaluate under this attention instead of the trained one.
        dropped_mass: Also measure the dropped mass (and the error law).

    Returns:
        The report (``format_table`` prints it; ``write_report`` saves it).

    Raises:
        EvalError: A non-finite result.
    """
    params, model_cfg = run_load.with_attention(run, attention) if attention else (run.params, run.cfg.model)
    alphas = alpha_lib.layer_alphas(params, model_cfg.attention, model_cfg.num_layers)
    frozen_params, frozen_cfg = frozen_alphas(params, model_cfg)
    rows_tokens = run.cfg.eval.batch_size * run.cfg.seq_len
    mesh = eval_mesh(run.cfg)
    results, masses, laws = {}, {}, {}
    # the error law needs one softmax over a subset of the causal keys (NSA mixes three branches)
    law_applies = kinds.kind_of(model_cfg.attention).one_softmax
    windows = {"max_tokens": max_tokens, "rows_tokens": rows_tokens, "mesh": mesh}
    for name, stream in datasets.items():
        results[name] = [r.as_dict() for r in evaluate_lengths(frozen_cfg, frozen_params, stream, lengths, **windows)]
        if dropped_mass:
            masses[name] = {str(n): dropped_mass_by_layer(frozen_cfg, frozen_params, stream, n, **windows) for n in lengths}
            if law_applies:
                laws[name] = {str(n): error_law(frozen_cfg, frozen_params, stream, n, **windows) for n in lengths}
    check_finite(run, results)
    report = {
        "run": run.cfg.name,
        "workdir": str(run.workdir),
        "step": run.step,
        "train_seq_len": run.cfg.seq_len,
        "lengths": lengths,
        "max_tokens": max_tokens,
        "devices": batching.mesh_devices(mesh),  # of every process: the windows were split over them
        "num_layers": model_cfg.num_layers,
        "attention": dataclasses.asdict(model_cfg.attention),
        "attention_override": attention is not None,
        "rope": rope_setting(model_cfg),
        "alphas": alphas,
        "alpha_init": alpha_lib.initial_alphas(model_cfg.attention, model_cfg.num_layers),
        "datasets": results,
        "new_distances": {str(n): new_distances(model_cfg.attention, alphas, run.cfg.seq_len, n) for n in lengths},
    }
    if dropped_mass:
        report["dropped_mass"] = masses  # dataset -> length -> per layer, vs dense attention
        if law_applies:
            report["error_law"] = laws  # dataset -> length -> per layer: fit of ||o - o_dense|| on the dropped mass
        else:
            report["error_law_skipped"] = NO_LAW.format(kind=model_cfg.attention.kind)
    return report


def frozen_alphas(params: dict, model_cfg) -> tuple[dict, object]:
    """A learned run as evaluation runs it: its final alphas compiled as constants (the same
    interpolated rungs, static shifts: the static path's cost) instead of traced parameters."""
    if not model_cfg.attention.is_learned:
        return params, model_cfg
    alphas = alpha_lib.layer_alphas(params, model_cfg.attention, model_cfg.num_layers)
    frozen = dataclasses.replace(model_cfg.attention, alpha=tuple(alphas), learn_alpha=False, interpolate=True)
    blocks = {i: {**b, "attn": {k: v for k, v in b["attn"].items() if k != alpha_lib.PARAM}} for i, b in params["blocks"].items()}
    return {**params, "blocks": blocks}, dataclasses.replace(model_cfg, attention=frozen)


def eval_mesh(cfg: TrainConfig):
    """A mesh over this job's devices (all processes'; in a one-process job at most the run's
    ``mesh.devices``), data parallel over windows, or None for one device. Every process reads
    the same windows; each device scores its share."""
    from fibjax.config import MeshConfig
    from fibjax.sharding import make_mesh

    devices = jax.devices()
    if cfg.mesh.devices and jax.process_count() == 1:  # at most as many as it took; a smaller machine uses what it has
        devices = devices[: cfg.mesh.devices]
    if len(devices) == 1:
        return None
    # windows are split over data x fsdp; tensor-parallel evaluation would replicate the work
    try:
        return make_mesh(dataclasses.replace(cfg.mesh, tensor=1) if cfg.mesh.tensor != -1 else MeshConfig(), devices)
    except ConfigError:
        return make_mesh(MeshConfig(), devices)


def check_finite(run: run_load.LoadedRun, results: dict[str, list[dict]]) -> None:
    """A NaN or infinite NLL is an error naming the run, step and dataset, never a result."""
    for name, rows in results.items():
        bad = [r for r in rows if not (math.isfinite(r["nll"]) and math.isfinite(r["ppl"]))]
        if bad:
            raise EvalError(
                f"{run.workdir} step {run.step}: the NLL on {name} at length {bad[0]['length']} is {bad[0]['nll']}, not a "
                "number; nothing was written. The checkpoint's parameters or the data are damaged."
            )


def inference_overrides(cfg: TrainConfig, mode: str | None, *, num_blocks: int | None = None, block_size: int | None = None) -> list[str]:
    """``--inference-mode full|sparse`` and a sparse budget as attention overrides.

    sparse = the run's SSA sparse stream, else its own sparse attention, else (a dense-trained
    run: paper B's "attention gap") MoBA blocks with the config's block budget."""
    out = []
    if mode == "full":
        out.append(f"kind={kinds.FULL}")
    elif mode == "sparse":
        own = cfg.model.attention.kind
        out.append(f"kind={cfg.ssa.sparse_kind if cfg.ssa.enabled else own if kinds.get(own).sparse else kinds.DEFAULT_SPARSE}")
    elif mode is not None:
        raise EvalError(f"--inference-mode must be full or sparse, got {mode!r}")
    if num_blocks is not None:
        out.append(f"num_blocks={num_blocks}")
    if block_size is not None:
        out.append(f"block_size={block_size}")
    name = apply_overrides(cfg.model.attention, out).kind
    kind = kinds.get(name)
    if (num_blocks or block_size) and not kind.block_budget:
        raise ConfigError(
            f"--num-blocks/--block-size set a block-sparse budget, but the evaluated attention is {name!r} "
            "(use --inference-mode sparse on a run whose sparse attention is block-sparse, or --attention kind=block_sparse)"
        )
    if block_size and kind.fixed_block_size:
        raise ConfigError(f"--block-size: {name}'s parameters are sized by the trained block size; change --num-blocks only")
    return out


def new_distances(acfg: AttentionConfig, alphas: list[float | None], train_len: int, length: int) -> list[int]:
    """Per layer: how many distances attended at ``length`` were never attended at ``train_len``
    (with the layer's current alpha). 0 means the layer only meets trained relative positions."""
    kind = kinds.kind_of(acfg)
    return [len(kind.reachable(acfg, a, length) - kind.reachable(acfg, a, train_len)) for a in alphas]


ROPE_KEYS = {"theta": "rope_theta", "scaling": "rope_scaling", "factor": "rope_factor", "original_len": "rope_original_len"}


def rope_overrides(items: list[str]) -> list[str]:
    """``launch.eval --rope`` words (theta=, scaling=, factor=, original_len=) as model overrides."""
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in ROPE_KEYS:
            raise ConfigError(f"--rope {item!r}: expected key=value with key one of {sorted(ROPE_KEYS)}")
        out.append(f"{ROPE_KEYS[key]}={value}")
    return out  # in any order: apply_overrides checks the model once with all of them


def with_rope(run: run_load.LoadedRun, items: list[str]) -> run_load.LoadedRun:
    """The run with its RoPE changed (theta, scaling): positions are not parameters, so the same
    weights are evaluated under another rotation, as after a context extension."""
    model = apply_overrides(run.cfg.model, rope_overrides(items))
    return dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, model=model))


def rope_setting(model_cfg) -> dict:
    return {key: getattr(model_cfg, field) for key, field in ROPE_KEYS.items()}


def evaluate_workdir(  # noqa: DOC502
    workdir: str | Path,
    *,
    step_number: int | None = None,
    lengths: list[int] | None = None,
    specs: dict[str, str] | None = None,
    max_tokens: int | None = None,
    attention_overrides: list[str] | None = None,
    dropped_mass: bool = False,
    rope: list[str] | None = None,
    tag: str | None = None,
) -> tuple[dict, Path]:
    """The whole evaluation of one run directory; returns the report and where it was written
    (by process 0 of a multi-process job; the others get None).

    Defaults come from the run's own config: lengths = eval.length_multipliers x seq_len, the
    run's validation sources, eval.max_tokens. ``rope``: RoPE overrides (``with_rope``).
    ``tag`` names the report file ``eval/<step>-<tag>.json`` (default: made from the settings).

    Args:
        workdir: The run directory.
        step_number: The checkpoint to evaluate (default: the latest).
        lengths: The evaluation lengths.
        specs: {name: data spec} of the validation data (default: the run's own).
        max_tokens: The most tokens scored at each length.
        attention_overrides: ``key=value`` overrides of the attention config.
        dropped_mass: Also measure the dropped mass.
        rope: RoPE overrides.
        tag: The report file's tag.

    Returns:
        (report, its path).

    Raises:
        EvalError: Data too short for the lengths, a non-finite result, or no room for the report.
    """
    run = run_load.load_run(workdir, step_number)
    if rope:
        run = with_rope(run, rope)
    lengths = list(lengths or [m * run.cfg.seq_len for m in run.cfg.eval.length_multipliers])
    attention = apply_overrides(run.cfg.model.attention, attention_overrides) if attention_overrides else None
    datasets = dataset_streams(run, specs)
    check_datasets(run, datasets, lengths, max_tokens or run.cfg.eval.max_tokens)
    room = report_room(len(lengths), len(datasets), run.cfg.model.num_layers, dropped_mass)
    distributed.on_main(lambda: check_writable(Path(workdir) / "eval", room), "checking where the report goes")
    report = evaluate_run(
        run, lengths=lengths, datasets=datasets, max_tokens=max_tokens or run.cfg.eval.max_tokens, attention=attention, dropped_mass=dropped_mass
    )
    report["data"] = specs or {"(the run's own validation sources)": str(run.data_dir)}
    # one file per evaluation setting, so a later evaluation never replaces the end-of-training one
    if tag is None:
        parts = [a.replace("=", "_") for a in [*(attention_overrides or []), *(f"rope_{r}" for r in rope or [])]]
        parts += sorted(data_part(k, v) for k, v in (specs or {}).items())
        parts += [f"len_{'_'.join(map(str, lengths))}"] if lengths != [m * run.cfg.seq_len for m in run.cfg.eval.length_multipliers] else []
        parts += [f"tokens_{max_tokens}"] if max_tokens and max_tokens != run.cfg.eval.max_tokens else []
        parts += ["dropped_mass"] if dropped_mass else []
        tag = "-".join(p.replace("/", "_") for p in parts)
    return report, distributed.on_main(lambda: write_report(workdir, report, tag), "writing the evaluation report")


def data_part(name: str, spec: str) -> str:
    """A report name's part for ``--data NAME=DIR[:SOURCE]``: the name and a hash of the resolved
    DIR:SOURCE, so that evaluations of other data under the same name never share a file."""
    directory, _, source = spec.partition(":")
    where = hashlib.sha256(f"{Path(directory).resolve()}:{source}".encode()).hexdigest()[:8]
    return f"data_{name}_{where}"


def check_datasets(run: run_load.LoadedRun, datasets: dict[str, np.ndarray], lengths: list[int], max_tokens: int) -> None:
    """Something to evaluate, before anything is: a run without validation data of its own (an
    imported model) needs ``--data``; every length scores the same tokens, cut into windows of
    the lengths' least common multiple, which each dataset must hold."""
    if not datasets:
        imported = (Path(run.workdir) / IMPORTED_FILE).exists()
        what = "was imported from Hugging Face: it holds its tokenizer but no validation text" if imported else "has no validation split"
        raise EvalError(
            f"{run.workdir} {what}; evaluate it on data prepared with its tokenizer: python -m launch.prepare_data --out DIR "
            f"--tokenizer {tokenizer_path(run.data_dir)} --source NAME=FILES, then python -m launch.eval --workdir {run.workdir} --data NAME=DIR"
        )
    unit = math.lcm(*lengths)
    short = {name: len(stream) for name, stream in datasets.items() if min(max_tokens, len(stream) - 1) < unit}
    if short:
        name, size = next(iter(short.items()))
        room = min(max_tokens, size - 1)
        doubling = [min(lengths) * 2**i for i in range(len(set(lengths)))]
        example = f"e.g. {','.join(map(str, doubling))}" if doubling[-1] <= room else f"with a least common multiple of at most {room}"
        within = f"every length scores the same tokens, in windows of their least common multiple ({unit} tokens), but {name} holds {size} tokens"
        within += f", of which {max_tokens} are scored (--max-tokens; default: the run's eval.max_tokens)" if max_tokens < size - 1 else ""
        raise EvalError(f"--lengths {','.join(map(str, lengths))}: {within}; pass lengths that are multiples of one another ({example})")


def report_room(lengths: int, datasets: int, num_layers: int, dropped_mass: bool) -> int:
    """A generous size for a report (a 4-layer run at 3 lengths writes 2.2 KiB): 16 KiB, and per
    dataset and length 1 KiB, with 256 bytes a layer for the dropped mass and error law."""
    return 16 * 1024 + lengths * datasets * (1024 + (256 * num_layers if dropped_mass else 0))


def check_writable(directory: Path, nbytes: int = 16 * 1024) -> None:
    """An evaluation's report can be written to ``directory`` (or, before it exists, the nearest
    directory above it): checked before the evaluation, not after it, by writing and syncing a
    file of the report's size there (an empty file fits on a full disk), then removing it."""
    where = next(p for p in [directory, *directory.absolute().parents] if p.is_dir())
    try:
        with tempfile.TemporaryFile(dir=where, prefix=".room-check-") as f:
            f.write(bytes(nbytes))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if disk_full(e):
            raise EvalError(
                f"no room for the evaluation report in {where}: {e.strerror or e} ({free_space(where)} free; the report needs up to "
                f"{human_bytes(nbytes)}); nothing was evaluated. Free some space and run the same command"
            ) from None
        raise EvalError(
            f"cannot write the evaluation report in {where}: {e.strerror or e}; nothing was evaluated. Make it writable, "
            "or evaluate a copy of the run directory made elsewhere"
        ) from None


def write_report(workdir: str | Path, report: dict, tag: str = "") -> Path:
    """Write ``RUN/eval/<step>[-tag].json`` atomically (a temporary file, then os.replace).

    Raises ReportNotWritten, carrying the report, when the directory is not writable.

    Args:
        workdir: The run directory.
        report: The report.
        tag: The file name's tag ("" for none).

    Returns:
        The report's path.

    Raises:
        EvalError: The report holds a non-finite number.
        ReportNotWritten: The directory is not writable.
    """
    out = Path(workdir) / "eval" / f"{report['step']}{'-' + tag if tag else ''}.json"
    try:
        text = json.dumps(report, indent=2, allow_nan=False) + "\n"
    except ValueError:
        raise EvalError(f"the evaluation of {workdir} step {report['step']} holds a non-finite number; {out} was not written") from None
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # a name of its own: two evaluations writing one report never share a temporary file
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)  # as a report written in place would be, not mkstemp's 0600
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except OSError as e:
        with contextlib.suppress(OSError, TypeError):
            Path(tmp).unlink(missing_ok=True)
        raise ReportNotWritten(f"the evaluation of {workdir} step {report['step']} could not be written to {out}: {e.strerror or e}", report) from None
    return out


def format_table(report: dict) -> str:
    """The report as text: a heading naming the run, a Markdown table of NLL and perplexity per
    dataset and length (with the change against the first length), then the alphas, the new
    distances, the dropped mass and the error law where the report has them.

    Args:
        report: A report of ``evaluate_run``.

    Returns:
        The table's text.
    """
    where = f" ({report['workdir']})" if "workdir" in report else ""
    rope = report.get("rope", {})
    scaled = f"; RoPE {rope['scaling']} x{rope['factor']:g}, theta {rope['theta']:g}" if rope.get("scaling", "none") != "none" else ""
    lines = [
        f"{report['run']}{where} step {report['step']} (trained at {report['train_seq_len']} tokens{scaled})",
        "| dataset | length | tokens | NLL | ppl | change vs first length |",
        "|---|---:|---:|---:|---:|---:|",
    ]
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
    if "error_law_skipped" in report:
        lines.append(f"error law: not fitted: {report['error_law_skipped']}")
    for name, by_length in report.get("error_law", {}).items():
        for length, layers in by_length.items():
            lines.append(
                f"error law, {name} @ {length}: ||o - o_dense|| / dropped mass, slope per layer "
                + " ".join(f"{x['slope']:.2f}" for x in layers)
                + f"; R^2 >= {min(x['r2'] for x in layers):.2f}; bound 2 m max||v|| broken by {sum(x['bound_violations'] for x in layers)}"
                f" of {sum(x['queries'] for x in layers)} queries"
            )
    return "\n".join(lines)
