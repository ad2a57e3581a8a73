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
shard's length, the tokenizer, an empty workdir); a failure is one :class:`UnsupportedModel`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np

from fibjax import kinds
from fibjax.config import DataConfig, MeshConfig, TrainConfig, to_dict
from fibjax.data import token_files
from fibjax.data.prepare import prepare_tokenizer_only
from fibjax.data.tokenizer import TokenizerError, load_tokenizer
from fibjax.hf import safetensors, weights
from fibjax.hf.config import FAMILY, UnsupportedModel, hf_config, model_config, read_json
from fibjax.hf.params import hf_tensors, place
from fibjax.run.workdir import IMPORTED_FILE as SOURCE_FILE

DATA_DIR = "data"
# what Orbax may copy to the host at once while writing the imported weights (more than the
# largest tensor): measured peak RSS of a 1 GB import, BUILD_NOTES "Hugging Face import"
IN_FLIGHT_BYTES = 64 * 2**20
# config.json fields that do not change the function but that a loader or generate() reads
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "initializer_range", "use_cache")
# Hugging Face's side files of a tokenizer, copied on export when the run came from a model directory
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _param_dtype(dtype: np.dtype) -> str:
    # float16 widens to float32 exactly; fibjax stores float32 or bfloat16
    return "bfloat16" if dtype.name == "bfloat16" else "float32"


def _check_empty(workdir: Path) -> None:
    if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise UnsupportedModel(f"--workdir {workdir} already exists and is not empty; choose a new one (nothing was written)")


def plan_import(model_dir: str | Path, *, dtype: str | None = None) -> tuple[dict, TrainConfig, dict, object]:
    """(Hugging Face config, the run's TrainConfig without its paths, the checked tensors, the
    tokenizer): every check of an import, reading headers and JSON only."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UnsupportedModel(f"{model_dir} is not a directory (a local Hugging Face model directory: config.json, *.safetensors, a tokenizer)")
    hf = read_json(model_dir / "config.json")
    probe = model_config(hf)  # the architecture first: a refused model is named before its tensors are read
    refs = weights.index(model_dir)
    stored = weights.check(probe, refs)
    param_dtype = _param_dtype(stored)
    model = dataclasses.replace(probe, param_dtype=param_dtype, dtype=dtype or param_dtype)
    try:
        tokenizer = load_tokenizer(model_dir)
    except TokenizerError as e:
        raise UnsupportedModel(f"{model_dir}: {e}") from None
    if tokenizer.vocab_size > model.vocab_size:
        raise UnsupportedModel(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocab_size {model.vocab_size}")
    seq_len = int(hf.get("max_position_embeddings") or 2048)
    cfg = TrainConfig(name=model_dir.name, seq_len=seq_len, model=model)
    return hf, cfg, refs, tokenizer


def import_model(model_dir: str | Path, workdir: str | Path, *, seq_len: int | None = None, dtype: str | None = None, mesh=None) -> TrainConfig:
    """Import the Hugging Face model in ``model_dir`` into the new run ``workdir``; returns its config.

    ``seq_len``: the run's training length, which sets the evaluation lengths (default: the
    source's ``max_position_embeddings``); ``dtype``: the compute dtype (default: the stored one)."""
    from fibjax.run.checkpoints import Checkpointer
    from fibjax.run.workdir import CONFIG_FILE, TOKENIZER_PIN
    from fibjax.sharding import make_mesh

    workdir = Path(workdir)
    _check_empty(workdir)
    hf, cfg, refs, tokenizer = plan_import(model_dir, dtype=dtype)
    data_dir = workdir / DATA_DIR
    cfg = dataclasses.replace(cfg, name=workdir.name, seq_len=seq_len or cfg.seq_len, data=DataConfig(path=str(data_dir)))
    # one device holds the weights while Orbax writes them (a data axis over many would replicate them)
    mesh = mesh or make_mesh(MeshConfig(data=1), jax.devices()[:1])
    params = place(cfg.model, refs, mesh)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        prepare_tokenizer_only(data_dir, tokenizer, str(Path(model_dir).resolve()))
        token_files.write_json_atomically(workdir / CONFIG_FILE, to_dict(cfg))
        (workdir / TOKENIZER_PIN).write_text(tokenizer.sha256 + "\n")
        source = {"model_dir": str(Path(model_dir).resolve()), "model_type": hf["model_type"], "config": {k: hf[k] for k in CARRIED if k in hf}}
        token_files.write_json_atomically(workdir / SOURCE_FILE, source)
        largest = max(x.nbytes for x in jax.tree.leaves(params))
        ckpt = Checkpointer(workdir, cfg.checkpoint, save_in_flight_bytes=max(largest + 2**20, IN_FLIGHT_BYTES))
        try:
            ckpt.save(0, {"params": params}, wait=True)
        finally:
            ckpt.close()
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)  # it was empty: a half-written run is worse than none
        raise
    return cfg


def export_model(workdir: str | Path, out_dir: str | Path, *, step: int | None = None, model_type: str | None = None, dtype: str | None = None) -> Path:
    """Write the run's weights as a Hugging Face model directory ``out_dir`` (config.json,
    model.safetensors, the tokenizer). A model whose attention is not dense exports its weights
    with a statement (README.md, ``fibjax_attention`` in config.json) that transformers will run
    them with dense attention, which is not the function they were trained with."""
    from fibjax.run.load import load_run, run_tokenizer

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UnsupportedModel(f"{out_dir} already exists and is not empty; choose a new directory (nothing was written)")
    run = load_run(workdir, step)
    cfg = run.cfg.model
    source = _read_source(Path(workdir))
    model_type = model_type or source.get("model_type") or ("qwen2" if cfg.qkv_bias else "llama")
    if model_type not in FAMILY:
        raise UnsupportedModel(f"--model-type {model_type!r}: supported {', '.join(FAMILY)}")
    attention = cfg.attention
    notes = {}
    if kinds.kind_of(attention).sparse or run.cfg.ssa.enabled:  # transformers would run other attention
        notes["fibjax_attention"] = {**to_dict(attention), "ssa": run.cfg.ssa.enabled}
    config = hf_config(cfg, model_type, source.get("config", {}).get("max_position_embeddings", run.cfg.seq_len), {**source.get("config", {}), **notes})
    stored = np.dtype(dtype or cfg.param_dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    safetensors.write(out_dir / weights.SINGLE_FILE, hf_tensors(cfg, run.params, stored), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    run_tokenizer(run).save(out_dir)
    (out_dir / "README.md").write_text(_readme(Path(workdir), run.step, attention, notes))
    return out_dir


def _read_source(workdir: Path) -> dict:
    path = workdir / SOURCE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


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
