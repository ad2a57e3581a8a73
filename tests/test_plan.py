"""``launch.plan``: per-device bytes from shardings agree with XLA's view of the compiled step."""

import math
import subprocess
import sys

import jax
import numpy as np
from flax import nnx

from fibjax import sharding
from fibjax.config import apply_overrides, load_config_file
from fibjax.model import Transformer
from fibjax.plan import make_plan
from tests.helpers import ROOT, TINY


def tiny(*overrides):
    return apply_overrides(load_config_file(ROOT / "configs" / "tiny.py"), [*TINY, "mesh.devices=0", *overrides])


def test_sharded_bytes_match_the_compiled_arguments():
    cfg = tiny("mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1")
    plan = make_plan(cfg, sharding.make_mesh(cfg.mesh))
    shapes = jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))), nnx.Param))
    total_params = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in shapes)
    # fsdp 4 splits every matrix's embed dimension (32 % 4 == 0); norm scales stay whole
    assert total_params / 4 <= plan.params < total_params / 3, (plan.params, total_params)
    assert 1.9 * plan.params <= plan.opt_state <= 2.1 * plan.params  # Adam's two moments
    batch = plan.batch_rows * (cfg.seq_len + 1) * 4
    assert plan.batch_rows == cfg.global_batch // 8
    # XLA's arguments of the compiled step are the state and the batch we counted (+ step, rng)
    assert 0 <= plan.compiled["argument"] - (plan.params + plan.opt_state + batch) <= 64, plan.compiled
    assert plan.compiled["temp"] > 0 and plan.total > plan.compiled["argument"]


def run_plan(*args):
    proc = subprocess.run([sys.executable, "-m", "launch.plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_prints_the_table_and_names_a_missing_device_count():
    rc, out, err = run_plan("--config", "configs/tiny.py", "--no-compile", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    assert rc == 0, err
    assert "data 2 x fsdp 2 x tensor 2 (8 devices)" in out and "| parameters |" in out and "not compiled" in out
    rc, out, err = run_plan("--config", "configs/tiny.py", "mesh.data=-1")
    assert rc == 2 and "pass --devices N" in err, err
    rc, out, err = run_plan("--config", "configs/tiny.py", "--no-compile", "mesh.data=-1", "mesh.devices=4")
    assert rc == 0 and "data 4 x fsdp 1 x tensor 1 (4 devices)" in out, err


def test_the_sharded_step_never_reshards_through_a_full_copy():
    """On data x fsdp x tensor = 2 x 2 x 2 the partitioner finds every layout it needs: the
    residual stream is batch-split at block boundaries and the embedding's D gathered before the
    lookup (fibjax.model.batch_sharded, Transformer.lookup). Without them XLA warns "Involuntary
    full rematerialization" (a whole tensor copied to every device to reshard it)."""
    rc, out, err = run_plan("--config", "configs/tiny.py", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "model.d_model=64", "model.num_layers=2")
    assert rc == 0, err
    assert "peak estimate" in out
    assert "Involuntary full rematerialization" not in err, err[-2000:]
