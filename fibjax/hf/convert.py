"""A Hugging Face model directory -> a fibjax run directory, and a fibjax run -> that layout.

The run an import writes is a normal fibjax run of a dense model, so that every command works on
it unchanged (``launch.eval``, ``sample``, ``passkey``, ``harness``, ``bench``, and ``launch.train
init_from=RUN`` to continue it with another attention)::

    RUN/config.json        the TrainConfig (model mapped from config.json; data.path = RUN/data)
    RUN/data/              the source's tokenizer, as a prepared data directory without sources
    RUN/tokenizer.sha256   the pin every command checks data against
    RUN/checkpoints/0/     the weights (parameters only: nothing was trained)
    RUN/hf_source.json     where it came from and the config.json fields export writes back

Everything is checked before anything is written (config, every tensor's shape and dtype, every
shard's length, the tokenizer, an empty workdir); a failure is one [UnsupportedModel][fibjax.hf.UnsupportedModel].
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import signal
import socket
import threading
from pathlib import Path

import jax
import numpy as np

from fibjax import kinds
from fibjax.config import DataConfig, MeshConfig, TrainConfig, to_dict
from fibjax.data import token_files
from fibjax.data.prepare import prepare_tokenizer_only
from fibjax.data.tokenizer import TOKENIZER_CONFIG, TokenizerError, load_tokenizer
from fibjax.errors import FibjaxError
from fibjax.hf import params as params_lib
from fibjax.hf import safetensors, weights
from fibjax.hf.config import FAMILY, UnsupportedModel, hf_config, model_config, read_json, transformers_window
from fibjax.hf.params import hf_tensors, place
from fibjax.run.workdir import IMPORTED_FILE as SOURCE_FILE

DATA_DIR = "data"
# the source's side files, kept as they came so that an export writes them back (chat_template,
# pad_token, generation settings, ...): RUN/hf_files/
SIDE_DIR = "hf_files"
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json")
# what Orbax may copy to the host at once while writing the imported weights (more than the
# largest tensor): measured peak RSS of a 1 GB import, BUILD_NOTES "Hugging Face import"
IN_FLIGHT_BYTES = 64 * 2**20
# config.json fields that do not change the function but that a loader or generate() reads
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "initializer_range", "use_cache")
# an import in progress writes RUN's parent/.RUN.importing-HOST-PID, renamed to RUN when complete
IMPORTING = ".importing-"


def _param_dtype(dtype: np.dtype) -> str:
    # float16 widens to float32 exactly; fibjax stores float32 or bfloat16
    return "bfloat16" if dtype.name == "bfloat16" else "float32"


def _check_empty(workdir: Path) -> None:
    if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise UnsupportedModel(f"--workdir {workdir} already exists and is not empty; choose a new one (nothing was written)")


def plan_import(model_dir: str | Path, *, dtype: str | None = None) -> tuple[dict, TrainConfig, dict, object]:
    """(Hugging Face config, the run's TrainConfig without its paths, the checked tensors, the
    tokenizer): every check of an import but the weights' values (``place`` refuses NaN and inf
    as it reads them), reading headers, JSON and, for a tied model that stores its head, the two tables.

    Args:
        model_dir: The Hugging Face model directory.
        dtype: The compute dtype (default: the stored one).

    Returns:
        (config, TrainConfig, tensors, tokenizer).

    Raises:
        UnsupportedModel: Not a directory, or a model, tensor or tokenizer the import refuses.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UnsupportedModel(f"{model_dir} is not a directory (a local Hugging Face model directory: config.json, *.safetensors, a tokenizer)")
    hf = read_json(model_dir / "config.json")
    probe = model_config(hf)  # the architecture first: a refused model is named before its tensors are read
    refs = weights.index(model_dir)
    stored = weights.check(probe, refs)
    weights.check_tied(probe, refs)
    param_dtype = _param_dtype(stored)
    model = dataclasses.replace(probe, param_dtype=param_dtype, dtype=dtype or param_dtype)
    unfilled = params_lib.unfilled(model)
    if unfilled:  # an attention recorded by a fibjax export whose own parameters no checkpoint carries
        raise UnsupportedModel(
            f"config.json's fibjax_attention (kind {model.attention.kind}) needs parameters the checkpoint does not hold, e.g. {unfilled[0]}: "
            "remove fibjax_attention from config.json to import the weights as a dense model"
        )
    try:
        tokenizer = load_tokenizer(model_dir)
    except TokenizerError as e:
        raise UnsupportedModel(f"{model_dir}: {e}") from None
    if tokenizer.vocab_size > model.vocab_size:
        raise UnsupportedModel(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocab_size {model.vocab_size}")
    seq_len = hf.get("max_position_embeddings") or 2048
    cfg = TrainConfig(name=model_dir.name, seq_len=seq_len, model=model)
    return hf, cfg, refs, tokenizer


def _clear_stale(workdir: Path) -> None:
    """Remove what an import into ``workdir`` killed on this host left behind (its process is gone)."""
    host = socket.gethostname()
    for path in workdir.parent.glob(f".{glob.escape(workdir.name)}{IMPORTING}{glob.escape(host)}-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True


@contextlib.contextmanager
def _signals_deferred():
    """SIGTERM and SIGINT wait for the end of the block, then take their course (the caller's
    handler, or the default): Orbax's asynchronous save, interrupted halfway, leaves its event
    loop broken and prints tracebacks on the way out; after it, the import's cleanup runs."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


def import_model(  # noqa: DOC503
    model_dir: str | Path, workdir: str | Path, *, seq_len: int | None = None, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None
) -> TrainConfig:
    """Import the Hugging Face model in ``model_dir`` into the new run ``workdir``; returns its config.

    ``seq_len``: the run's training length, which sets the evaluation lengths (default: the
    source's ``max_position_embeddings``); ``dtype``: the compute dtype (default: the stored one).
    The run is written beside ``workdir`` under a temporary name and renamed into place when
    complete: an import that fails or is killed leaves no run (a killed one's temporary folder
    is removed by the next import into the same ``workdir``).

    Args:
        model_dir: The Hugging Face model directory.
        workdir: The new run directory.
        seq_len: The run's training length.
        dtype: The compute dtype.
        mesh: The device mesh to place the weights on (default: one device).

    Returns:
        The run's config.

    Raises:
        UnsupportedModel: A model the import refuses (``plan_import``).
    """
    from fibjax.run.checkpoints import Checkpointer
    from fibjax.run.workdir import CONFIG_FILE, TOKENIZER_PIN
    from fibjax.sharding import make_mesh

    workdir = Path(workdir)
    _check_empty(workdir)
    hf, cfg, refs, tokenizer = plan_import(model_dir, dtype=dtype)
    model_dir = Path(model_dir).resolve()
    cfg = dataclasses.replace(cfg, name=workdir.name, seq_len=seq_len or cfg.seq_len, data=DataConfig(path=str(workdir / DATA_DIR)))
    # one device holds the weights while Orbax writes them (a data axis over many would replicate them)
    mesh = mesh or make_mesh(MeshConfig(data=1), jax.devices()[:1])
    params = place(cfg.model, refs, mesh)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(workdir)
    tmp = workdir.parent / f".{workdir.name}{IMPORTING}{socket.gethostname()}-{os.getpid()}"
    try:
        tmp.mkdir()
        prepare_tokenizer_only(tmp / DATA_DIR, tokenizer, str(model_dir))
        (tmp / SIDE_DIR).mkdir()
        for name in SIDE_FILES:
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, tmp / SIDE_DIR / name)
        token_files.write_json_atomically(tmp / CONFIG_FILE, to_dict(cfg))
        (tmp / TOKENIZER_PIN).write_text(tokenizer.sha256 + "\n")
        source = {"model_dir": str(model_dir), "model_type": hf["model_type"], "config": {k: hf[k] for k in CARRIED if k in hf}}
        token_files.write_json_atomically(tmp / SOURCE_FILE, source)
        largest = max(x.nbytes for x in jax.tree.leaves(params))
        with _signals_deferred():
            ckpt = Checkpointer(tmp, cfg.checkpoint, save_in_flight_bytes=max(largest + 2**20, IN_FLIGHT_BYTES))
            try:
                ckpt.save(0, {"params": params}, wait=True)
            finally:
                ckpt.close()
        if workdir.exists():
            workdir.rmdir()  # empty (checked above); rename cannot replace a directory on every system
        tmp.rename(workdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cfg


def export_model(workdir: str | Path, out_dir: str | Path, *, step: int | None = None, model_type: str | None = None, dtype: str | None = None) -> Path:
    """Write the run's weights as a Hugging Face model directory ``out_dir`` (config.json,
    model.safetensors, the tokenizer). A model whose attention is not dense exports its weights
    with a statement (README.md, ``fibjax_attention`` in config.json) that transformers will run
    them with dense attention, which is not the function they were trained with; an import of
    the export reads ``fibjax_attention`` back. A run imported from Hugging Face, or continued
    from one with its tokenizer (``init_from``), gets the source's side files back as they came
    (tokenizer_config.json with its chat template, generation_config.json, ...).

    Args:
        workdir: The run directory.
        out_dir: The new model directory (absent or empty).
        step: The checkpoint to export (default: the latest).
        model_type: The Hugging Face model type (default: the source's, else qwen2 or llama).
        dtype: The stored dtype (default: the run's parameter dtype).

    Returns:
        ``out_dir``.

    Raises:
        UnsupportedModel: ``out_dir`` not empty, or an unsupported ``model_type``.
    """
    from fibjax.run.load import load_run, run_tokenizer

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UnsupportedModel(f"{out_dir} already exists and is not empty; choose a new directory (nothing was written)")
    run = load_run(workdir, step)
    cfg = run.cfg.model
    tokenizer = run_tokenizer(run)
    source, side_dir = _source_of(Path(workdir), tokenizer.sha256)
    model_type = model_type or source.get("model_type") or ("qwen2" if cfg.qkv_bias else "llama")
    if model_type not in FAMILY:
        raise UnsupportedModel(f"--model-type {model_type!r}: supported {', '.join(FAMILY)}")
    attention = cfg.attention
    notes = {}
    runs_same = transformers_window(cfg, model_type) is not None  # a sliding window transformers runs itself
    if (kinds.kind_of(attention).sparse and not runs_same) or run.cfg.ssa.enabled:  # transformers would run other attention
        notes["fibjax_attention"] = {**to_dict(attention), "ssa": run.cfg.ssa.enabled}
    stored = np.dtype(dtype or cfg.param_dtype)
    carried = source.get("config", {})
    config = hf_config(cfg, model_type, carried.get("max_position_embeddings", run.cfg.seq_len), {**carried, "torch_dtype": stored.name, **notes})
    out_dir.mkdir(parents=True, exist_ok=True)
    safetensors.write(out_dir / weights.SINGLE_FILE, hf_tensors(cfg, run.params, stored), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(out_dir)
    if side_dir is not None:
        _write_side_files(side_dir, out_dir, tokenizer)
    (out_dir / "README.md").write_text(_readme(Path(workdir), run.step, attention, notes))
    return out_dir


def _source_of(workdir: Path, tokenizer_sha256: str) -> tuple[dict, Path | None]:
    """(``hf_source.json``, the folder of its side files or None) of the run, or of the imported
    run it continues through ``init_from``; ({}, None) when neither came from Hugging Face or
    the tokenizer is no longer the source's."""
    from fibjax.run.workdir import load_run_config, pinned_tokenizer

    run, seen = workdir, set()
    while run.resolve() not in seen:
        seen.add(run.resolve())
        if (run / SOURCE_FILE).is_file():
            if pinned_tokenizer(run) != tokenizer_sha256:
                return {}, None
            side = run / SIDE_DIR
            return json.loads((run / SOURCE_FILE).read_text()), side if side.is_dir() else None
        try:
            init_from = load_run_config(run).init_from
        except (FibjaxError, OSError):
            return {}, None
        if not init_from:
            return {}, None
        run = Path(init_from)
    return {}, None


def _write_side_files(side_dir: Path, out_dir: Path, tokenizer) -> None:
    """Copy the source's side files into ``out_dir`` as they came; where they no longer give the
    run's special tokens (its tokenizer's sha256), the three keys that say them are set in
    tokenizer_config.json and nothing else is changed."""
    for name in SIDE_FILES:
        if (side_dir / name).is_file():
            shutil.copyfile(side_dir / name, out_dir / name)
    if load_tokenizer(out_dir).sha256 == tokenizer.sha256:
        return
    path = out_dir / TOKENIZER_CONFIG
    settings = json.loads(path.read_text()) if path.is_file() else {}
    settings.update(bos_token=tokenizer.token(tokenizer.bos_id), eos_token=tokenizer.token(tokenizer.eos_id), add_bos_token=tokenizer.add_bos)
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def _readme(workdir: Path, step: int, attention, notes: dict) -> str:
    lines = [f"# Exported by fibjax from {workdir} (step {step})", ""]
    if notes:
        lines += [
            f"**Its attention is not dense.** This model was trained with fibjax's `{attention.kind}` attention "
            f"(`fibjax_attention` in config.json). `transformers` will run these weights with dense causal attention, "
            "which is a different function: its outputs will not match fibjax's. Load the weights into fibjax "
            "(`python -m launch.import_hf`) and evaluate with `--attention` to run the attention it was trained with.",
            "",
        ]
    else:
        lines += ["Dense causal attention: `transformers` computes the same function fibjax does (tested to float32 tolerance).", ""]
    return "\n".join(lines)
