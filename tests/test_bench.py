"""The benchmark CLI runs end to end on tiny shapes (its figures are only meaningful on real ones),
and its ratios are taken round by round."""

import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from fibjax.bench.timing import Measurement, ratio
from launch import bench
from tests.helpers import ROOT, TINY_MODEL


def test_attention_bench_interleaves_rounds_and_prints_ratios(capsys):
    assert bench.main(["attention", "--seq", "64", "--paths", "static,learned_frozen", "--repeats", "2", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "rounds=3" in out
    rows = re.findall(r"\| 64 \| (\w+) \| [\d.]+ \| [\d.]+ \|", out)
    assert rows == ["static", "learned_frozen"]
    assert re.search(r"\| 64 \| learned_frozen / static \| [\d.]+ \| [\d.]+ \|", out)


def test_a_ratio_is_the_median_of_the_rounds_ratios():
    # round 2 ran under load for both paths: per-round ratios 2, 2, 1.5 (median 2); medians 30 / 20
    num = Measurement(ms=30.0, spread_ms=0, peak_mb=0, round_ms=(20.0, 200.0, 30.0))
    den = Measurement(ms=20.0, spread_ms=0, peak_mb=0, round_ms=(10.0, 100.0, 20.0))
    assert ratio(num, den) == pytest.approx(2.0)
    lone = Measurement(ms=30.0, spread_ms=0, peak_mb=0)
    assert ratio(lone, den) == pytest.approx(1.5)


def test_attention_bench_refuses_zero_rounds(capsys):
    with pytest.raises(SystemExit):
        bench.main(["attention", "--seq", "64", "--paths", "static", "--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_attention_bench_with_nothing_to_time_reports_the_skip(capsys):
    """cuDNN is not on a CPU: the path is skipped, and the rounds have nothing to time."""
    assert bench.main(["attention", "--seq", "64", "--paths", "cudnn", "--rounds", "2"]) == 0
    assert "cudnn: skipped" in capsys.readouterr().err


def test_kernel_check_passes_what_agrees_and_fails_what_does_not(monkeypatch, capsys):
    """``launch.bench kernels``' verdict, with XLA standing in for the Pallas kernels (the kernels
    themselves are compared with the oracle in test_pallas.py): an exact copy passes, an output off
    by more than the float32 tolerance fails (exit status 1), and a kernel that raises is named."""
    from fibjax.attention.offset_xla import offset_attention_xla
    from fibjax.bench import kernels

    def pairs(case, blocks):
        xla = lambda q, k, v, a: offset_attention_xla(q, k, v, distances=(0, 1, 3), return_lse=True)  # noqa: E731
        off = lambda q, k, v, a: (lambda o: (o[0] + 1e-3, o[1]))(xla(q, k, v, a))  # noqa: E731
        return {"same": (xla, xla), "off": (off, xla), "broken": (lambda *a: 1 / 0, xla)}

    monkeypatch.setattr(kernels, "_pairs", pairs)
    case = kernels.KernelCase(16, 2, 1, "float32", head_dim=4, batch=1)
    assert kernels.run([case], kernels.BlockSizes(), 0, [], "float32", 1) == 1
    lines = capsys.readouterr().out.splitlines()
    verdict = {line.split(": ")[0].split()[-1]: line for line in lines if line.startswith("T=16")}
    assert verdict["same"].endswith("PASS") and "out 0.00e+00" in verdict["same"]
    assert verdict["off"].endswith("FAIL") and "out 1.00e-03" in verdict["off"]
    assert "FAILED ZeroDivisionError" in verdict["broken"]
    assert lines[-1] == "blocks: 128,128,4,2"


def test_train_bench_names_the_devices_each_config_ran_on(capsys):
    # 8 simulated devices (conftest); the override caps the mesh at 2, which the row must say
    tiny = [*TINY_MODEL, "model.num_layers=1", "seq_len=32", "global_batch=2"]  # one layer, 2 rows: a short step
    assert bench.main(["train", "--configs", "configs/cpu/dense.py", "--steps", "1", "mesh.devices=2", *tiny]) == 0
    out = capsys.readouterr().out
    assert "available devices=8" in out
    row = next(line for line in out.splitlines() if line.startswith("| dense "))
    assert row.split("|")[4].strip() == "2"


def test_attention_bench_times_the_block_sparse_kernel(capsys):
    """The Pallas block-sparse row (interpret mode here) and its ratio to the XLA path."""
    assert bench.main(["attention", "--seq", "64", "--paths", "block_sparse,block_sparse_pallas", "--repeats", "1", "--pallas-blocks", "32,32"]) == 0
    assert re.search(r"\| 64 \| block_sparse_pallas / block_sparse \| [\d.]+ \| [\d.]+ \|", capsys.readouterr().out)


def test_attention_bench_times_kernel_variants_side_by_side(capsys):
    """``--pallas-variants``: one block_sparse_pallas row per variant in one run (the plain name for
    the default), each variant's time over the default's; an unknown name is refused."""
    argv = ["attention", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--repeats", "1", "--pallas-blocks", "32,32"]
    assert bench.main([*argv, "--paths", "block_sparse_pallas", "--pallas-variants", "default,skip_padding"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"\| 64 \| ([\w:]+) \| [\d.]+ \| [\d.]+ \|", out) == ["block_sparse_pallas", "block_sparse_pallas:skip_padding"]
    assert re.search(r"\| 64 \| block_sparse_pallas:skip_padding / block_sparse_pallas \| [\d.]+ \| [\d.]+ \|", out)
    with pytest.raises(SystemExit):
        bench.main([*argv, "--pallas-variants", "default,fastest"])
    assert "unknown --pallas-variants ['fastest']" in capsys.readouterr().err


def test_window_rows_attend_as_many_keys_per_query_as_the_static_rows(capsys):
    """The window kind's XLA row at W = the static rows' keys per query (cudnn_window: skipped off a
    GPU), the same attended pairs in the FLOP model, and static / window printed."""
    from fibjax.bench import attention as attn_bench
    from fibjax.bench import roofline

    case = attn_bench.Case(seq_len=4096)
    assert case.window_keys == len(case.distances) > case.window + 1
    assert roofline.pairs(case, "window") == roofline.pairs(case, "cudnn_window")
    assert abs(roofline.pairs(case, "window") / roofline.pairs(case, "static") - 1) < 0.1  # equal keys but for the first rungs' queries
    assert (
        bench.main(
            ["attention", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--paths", "static,window,cudnn_window", "--repeats", "1"]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "cudnn_window: skipped" in captured.err
    assert re.search(r"\| 64 \| static / window \| [\d.]+ \| [\d.]+ \|", captured.out)


def test_train_bench_times_its_configs_in_rounds(monkeypatch, capsys):
    """Every config is compiled before any is timed, then each round times every config in turn."""
    from fibjax.bench import train as train_bench

    order = []
    timed = train_bench._Run.time
    monkeypatch.setattr(train_bench._Run, "time", lambda self, steps: order.append((self.cfg.model.attention.kind, steps)) or timed(self, steps))
    tiny = [*TINY_MODEL, "model.num_layers=1", "seq_len=32", "global_batch=2", "mesh.devices=1"]
    assert bench.main(["train", "--configs", "configs/cpu/dense.py,configs/cpu/fib_stagger_w8.py", "--steps", "2", "--rounds", "2", *tiny]) == 0
    assert order == [("dense", 1), ("offset", 1)] + [("dense", 2), ("offset", 2)] * 2  # compile steps, then the rounds
    assert "rounds=2" in capsys.readouterr().out


def test_an_external_path_joins_the_rounds(monkeypatch):
    """An external path (torch_sdpa) is timed in every round beside the JAX paths, not once before
    them, so its ratios are per-round ratios like theirs."""
    from fibjax.bench import attention as attention_bench
    from fibjax.bench.timing import of_rounds

    calls = []

    class Fake:
        peak_mb = float("nan")

        def __init__(self, mode):
            self.mode = mode

        def times(self, repeats):
            calls.append(self.mode)
            return [1.0] * repeats

        def measurement(self, rounds_ms):
            return of_rounds(rounds_ms, self.peak_mb)

    monkeypatch.setitem(attention_bench.EXTERNAL, "torch_sdpa", (lambda: True, lambda q, k, v: {m: Fake(m) for m in ("fwd", "fwd+bwd")}))
    res = attention_bench.run(attention_bench.Case(seq_len=32), ["static", "torch_sdpa"], repeats=1, rounds=3)
    assert calls.count("fwd") == 3 and calls.count("fwd+bwd") == 3
    assert len(res[("torch_sdpa", "fwd")].round_ms) == 3 and len(res[("static", "fwd")].round_ms) == 3


@pytest.mark.parametrize("path", ["dense", "block_sparse", "nsa", "learned"])
def test_a_path_split_over_head_devices_computes_the_same_attention(path):
    """--cpu-devices times each path per head shard: the same function, output and gradients."""
    from fibjax.bench import attention as attn_bench

    case = attn_bench.Case(seq_len=64, sparse_block=8, sparse_blocks=3, nsa_window=7)
    mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
    f = attn_bench.PATHS[path](case)
    alpha = np.float32(case.alpha)
    whole, split = attn_bench.inputs(case), attn_bench.inputs(case, mesh)
    assert split[0].sharding.spec[2] == "tensor"
    per_shard = attn_bench._per_head_shard(f, mesh)
    for want_fn, got_fn in ((f, per_shard), (attn_bench.forward_backward(f), attn_bench.forward_backward(per_shard))):
        got, want = jax.jit(got_fn)(*split, alpha), jax.jit(want_fn)(*whole, alpha)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_cpu_devices_run_the_bench_on_that_many_devices():
    """A fresh process: the devices are made before JAX's backend starts (the suite's own 8 are
    already up in this one, which the next test covers)."""
    cmd = [sys.executable, "-m", "launch.bench", "attention", "--seq", "64", "--paths", "dense,block_sparse", "--repeats", "1", "--cpu-devices", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "devices=[CpuDevice(id=0), CpuDevice(id=1)]" in out.stdout
    assert re.search(r"\| 64 \| block_sparse / dense \| [\d.]+ \| [\d.]+ \|", out.stdout)


def test_cpu_devices_refused_once_the_backend_is_up(capsys):
    assert len(jax.devices()) == 8  # the suite's devices are up (and stay 8 for this worker's other tests)
    with pytest.raises(SystemExit):
        bench.main(["attention", "--seq", "64", "--paths", "dense", "--cpu-devices", "2"])
    assert "cannot make 2 CPU devices: JAX's backend started first" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["attention", "--seq", "64", "--paths", "dense", "--cpu-devices", "3"])
    assert "divide --kv-heads 8" in capsys.readouterr().err
