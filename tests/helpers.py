"""Constants and helper functions shared by several test modules, imported explicitly
(``from tests.helpers import TINY``) so a reader sees where each name comes from. Fixtures live
in ``tests/conftest.py``, where pytest finds them without an import; pytest's documentation
advises against importing from a conftest file.

Sections: the tiny model and running ``launch.train`` on it; error lines; fake evaluated run
directories for the report, plot and study tests; the sharded train step lowered on the 8
simulated devices.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fibjax import sharding
from fibjax.config import MeshConfig, TrainConfig
from fibjax.train import step
from fibjax.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent

# The tiny model, the one definition: two layers of width 32 over a 384-token tokenizer (the
# smallest the embedded corpus allows), so a run trains in seconds.
TINY_VOCAB = 384
TINY_MODEL = ("model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", f"model.vocab_size={TINY_VOCAB}")
# A run of it on the embedded corpus (prepared at the model's vocabulary when no data.path is
# given), for end-to-end tests of commands. One of the 8 simulated devices: a tiny run sharded 8
# ways spends its time compiling (4 s more per run, cold); tests of the sharded loop say
# mesh.devices=0 (every device).
TINY_RUN = (*TINY_MODEL, "seq_len=32", "global_batch=8", f"data.default_vocab_size={TINY_VOCAB}", "mesh.devices=1")
# The training-loop tests: a run that logs every step and evaluates nothing unless a test asks
# for it (configs/tiny.py draws a validation curve every 20 steps).
TINY = [*TINY_RUN, "eval.at_end=false", "eval.every_steps=0", "optim.warmup_steps=2", "log_every=1"]
# The sparse-training tests (SSA, NSA): 64 tokens, 8 blocks of 8 of which each query picks 2 (at
# 32 tokens it would pick half); every device along data; lr 3e-3, as those tests ask 20-30
# steps to lower the loss by 0.5. Each module adds its step count. Two sequences per device: with
# one per device on 8 devices, the MoBA step loaded from a warm persistent compilation cache
# aborts the process (a JAX fault, BUILD_NOTES "Tests and CI").
TINY_SPARSE = (
    *TINY_MODEL,
    "seq_len=64",
    "global_batch=16",
    "optim.lr=3e-3",
    "optim.warmup_steps=3",
    "model.attention.block_size=8",
    "model.attention.num_blocks=2",
    "eval.at_end=false",
    "mesh.data=-1",
)


def train_cmd(workdir, data_dir, *overrides, env=None, wait=True):
    """``python -m launch.train`` on the tiny model in a subprocess (for tests that kill or signal
    it): with ``wait``, its exit code and output, else the running process."""
    cmd = [sys.executable, "-m", "launch.train", "--workdir", str(workdir), "--no-progress", *TINY, f"data.path={data_dir}", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def train_main(capsys, workdir, data, *overrides) -> tuple[int, str]:
    """``python -m launch.train`` in this process (no interpreter start and JAX import per run):
    its exit code and everything it printed."""
    from launch.train import main

    rc = main(["--workdir", str(workdir), "--no-progress", *TINY, f"data.path={data}", *overrides])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def finished_tiny_run(workdir, data_dir, *settings):
    """A tiny run trained to its end by ``launch.train`` (a module fixture's run, copied by each test that changes it)."""
    from launch.train import main

    assert main(["--workdir", str(workdir), "--no-progress", *TINY, *settings, f"data.path={data_dir}"]) == 0
    return workdir


def losses(workdir):
    return [(r["step"], r["loss"]) for r in read_metrics(workdir)]


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def assert_one_error(rc: int, out: str, *fragments: str) -> str:
    """Exit 2, exactly one ``error:`` line holding every fragment, and no traceback."""
    errors = error_lines(out)
    assert rc == 2 and len(errors) == 1 and "Traceback" not in out, out
    for fragment in fragments:
        assert fragment in errors[0], (fragment, out)
    return errors[0]


def flip_bytes(step_dir):
    """Change bytes in the middle of the largest file of a step, keeping its size (what Orbax
    does not notice: the zstd frames carry no checksum)."""
    target = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 400, 4):
        data[i - 1 : i + 1] = b"\xc0\x7f"
    target.write_bytes(bytes(data))


# Fake evaluated runs: the per-bin NLLs every length row gets unless a test gives its own.
STAGGER_BINS = [3.9, 3.8, 3.75, 3.72, 3.7, 3.69, 3.68, 3.67]
ATTN = {
    "kind": "offset",
    "window": 8,
    "base": "fibonacci",
    "alpha": "staggered",
    "learn_alpha": False,
    "block_size": 16,
    "num_blocks": 16,
    "implementation": None,
}


def rows_for(ppls, bins=STAGGER_BINS, train_len=1024, tokens=8192):
    return [{"length": train_len * 2**i, "tokens": tokens, "nll": math.log(p), "ppl": p, "bin_nll": list(bins)} for i, p in enumerate(ppls)]


def fake_run(root, name, *, datasets, attention=None, alphas=(0.5, 1.0, 1.5), step=100, train_len=1024, metrics=True, tag=""):
    """A run directory with RUN/eval/<step>[-tag].json and metrics.jsonl, as the trainer writes them."""
    workdir = root / name
    (workdir / "eval").mkdir(parents=True, exist_ok=True)
    report = {
        "run": name,
        "step": step,
        "train_seq_len": train_len,
        "lengths": [r["length"] for r in next(iter(datasets.values()))],
        "attention": attention or ATTN,
        "attention_override": bool(tag),
        "alphas": list(alphas),
        "datasets": datasets,
    }
    (workdir / "eval" / f"{step}{'-' + tag if tag else ''}.json").write_text(json.dumps(report))
    if metrics:
        loss = 8.0 * np.exp(-np.arange(1, step + 1) / 40) + 3.5 + 0.05 * np.sin(np.arange(step))
        (workdir / "metrics.jsonl").write_text("".join(json.dumps({"step": s + 1, "loss": float(v), "lr": 1e-3}) + "\n" for s, v in enumerate(loss)))
    return workdir


def inside_the_figure(fig) -> list[str]:
    """The titles (the figure's, every panel's) of a matplotlib figure that run past its edges."""
    fig.draw_without_rendering()
    texts = [*fig.texts, *(ax.title for ax in fig.axes if ax.get_visible())]
    return [t.get_text() for t in texts if t.get_text() and not (-1 <= t.get_window_extent().x0 and t.get_window_extent().x1 <= fig.bbox.width + 1)]


# The sharded train step on the 8 simulated devices (tests/conftest.py).
EIGHT = MeshConfig(data=2, fsdp=2, tensor=2)
# The logical rules (fibjax/sharding.py) as they should land: mesh axes per dimension of
# each parameter, by name (all dimensions of the shapes used here divide by 2).
EXPECTED_AXES = {
    "embedding": ("tensor", "fsdp"),  # [vocab, embed]
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "gate", "up"), ("fsdp", "tensor")),  # [embed, heads | kv_heads | mlp]
    **dict.fromkeys(("o_proj", "down"), ("tensor", "fsdp")),  # [heads | mlp, embed]
    "attn_norm": ("fsdp",),
    "mlp_norm": ("fsdp",),
    "final_norm": ("fsdp",),
}


def lowered_args(lowered) -> list[tuple[tuple[tuple[str, ...], ...], bool]]:
    """(mesh axes of each dimension, donated) of each argument of the lowered program, read from
    its text (Shardy annotations): what the compiler gets, whatever the Python side meant."""
    signature = re.search(r"@main\((.*?)\) ->", lowered.as_text(), re.S)[1]
    out = []
    for arg in signature.split("%arg")[1:]:
        dims = re.search(r"sdy\.sharding<@mesh, \[(.*?)\]>", arg)[1]
        out.append((tuple(tuple(re.findall(r'"(\w+)"', d)) for d in re.findall(r"\{(.*?)\}", dims)), "tf.aliasing_output" in arg))
    return out


def check_sharded_as_the_rules_say(trainer, lowered, batch) -> None:
    """Parameters and their Adam moments are sharded by the rules, everything else in the state
    is replicated, the batch is split over data x fsdp, every state buffer is donated into its
    update (aliasing needs equal input and output shardings), and the loss is a float32 scalar."""
    leaves = jax.tree_util.tree_flatten_with_path((trainer.abstract_state, batch))[0]
    args = lowered_args(lowered)
    assert len(args) == len(leaves)
    checked = 0
    for (path, x), (axes, donated) in zip(leaves, args):
        where = jax.tree_util.keystr(path)
        if path == (jax.tree_util.SequenceKey(1),):
            assert axes == (("data", "fsdp"), ()) and not donated
            continue
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if {"params", "mu", "nu"} & set(keys):
            name = next(k for k in reversed(keys) if k in EXPECTED_AXES)
            assert axes == tuple((a,) for a in EXPECTED_AXES[name]), (where, axes)
            checked += 1
        else:
            assert axes == ((),) * x.ndim, (where, axes)
        assert donated, where
    assert checked == 3 * len(jax.tree.leaves(trainer.abstract_state["params"]))
    loss = lowered.out_info[1]["loss"]
    assert loss.shape == () and loss.dtype == jnp.float32


def lower_on_eight_devices(cfg: TrainConfig, platform: str | None = None):
    """The train step for ``cfg`` on the 8 simulated devices, lowered from abstract state (nothing
    allocated) for ``platform`` (None: this CPU, to compile)."""
    assert len(jax.devices()) == 8, "tests/conftest.py asks for 8 simulated CPU devices"
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = step.build(cfg, mesh)
    batch = jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len + 1), jnp.int32, sharding=trainer.batch_sharding)
    with jax.set_mesh(mesh):
        lowered = trainer.step.trace(trainer.abstract_state, batch).lower(lowering_platforms=(platform,) if platform else None)
    return trainer, lowered, batch
