"""Peak host memory of a Hugging Face import (``python -m launch.bench hf_import``).

Writes a random Llama-layout checkpoint of about ``size_gb`` (bfloat16, ``fibjax.hf.synthetic``),
then runs ``python -m launch.import_hf`` on it as a child process, as a user would, and reads
the child's peak resident set (``getrusage``) against the checkpoint's bytes. A second child
that only starts JAX and imports fibjax gives the floor every command pays, so the table shows
what the import itself adds. The target (issue 38): peak RSS <= 1.5x the checkpoint.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes

from fibjax.hf import synthetic

# a Llama-1B-like shape (TinyLlama's widths); the layer count sets the size
WIDTHS = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
FLOOR = "import jax, fibjax.hf, fibjax.run.checkpoints; jax.devices()"


def config_for(size_gb: float) -> dict:
    d, f, v, kv = WIDTHS["hidden_size"], WIDTHS["intermediate_size"], WIDTHS["vocab_size"], WIDTHS["num_key_value_heads"] * 64
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    layers = max(1, round((size_gb * 2**30 / 2 - 2 * v * d) / per_layer))
    return {"model_type": "llama", **WIDTHS, "num_hidden_layers": layers, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": False}


def _child_peak(command: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of one child process; each measurement runs in a fresh
    interpreter, since getrusage's children figure is the maximum over every waited-for child."""
    probe = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-2000:]}")
    return time.perf_counter() - start, int(out.stdout.strip().splitlines()[-1]) * 1024  # ru_maxrss is in KiB on Linux


def run(size_gb: float, directory: str | None = None, shards: int = 2) -> str:
    root = Path(directory or tempfile.mkdtemp(prefix="fibjax-hf-bench-"))
    model_dir, workdir = root / "model", root / "run"
    try:
        hf = config_for(size_gb)
        synthetic.write_model(model_dir, hf, shards=shards, dtype=ml_dtypes.bfloat16, std=0.02)
        checkpoint = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        floor_s, floor = _child_peak([sys.executable, "-c", FLOOR])
        seconds, peak = _child_peak([sys.executable, "-m", "launch.import_hf", str(model_dir), "--workdir", str(workdir), "--seq-len", "256"])
        written = sum(p.stat().st_size for p in (workdir / "checkpoints").rglob("*") if p.is_file())
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        rows = [
            f"model: {hf['num_hidden_layers']} layers x d_model {hf['hidden_size']}, bfloat16, {shards} shards: checkpoint {gib(checkpoint)}",
            f"floor (start JAX, import fibjax): peak RSS {gib(floor)} in {floor_s:.1f} s",
            f"import_hf: peak RSS {gib(peak)} in {seconds:.1f} s; Orbax checkpoint written {gib(written)}",
            f"peak RSS / checkpoint: {peak / checkpoint:.2f} (target <= 1.5); above the floor: {(peak - floor) / checkpoint:.2f}",
        ]
        return "\n".join(rows)
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
