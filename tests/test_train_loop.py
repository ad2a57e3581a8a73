"""The training loop end to end: exact resume after SIGKILL, preemption, bad inputs, NaN.

Runs go through ``python -m launch.train``: in subprocesses where a test kills or signals the
process, else its ``main`` in this process (``train_main``: no interpreter start and JAX import per
run). The tiny model trains on a small prepared dataset shared by the tests of this module.
"""

import gzip
import json
import signal
import time

import numpy as np
import pytest

from fibjax.data import prepare_default
from fibjax.train.metrics import read_metrics
from tests.helpers import TINY, losses, train_cmd, train_main
from tests.tiers import slow


def test_exact_resume_after_sigkill(tmp_path, data_dir, capsys):
    """Killed (SIGKILL) right after its step-n save, a run resumed by a new process continues
    bit-identically, sharded over all 8 devices. (The uninterrupted run runs in this process.)"""
    n = 4
    args = (f"steps={2 * n}", f"checkpoint.every_steps={n}", "mesh.devices=0")
    rc, out = train_main(capsys, tmp_path / "straight", data_dir, *args)
    assert rc == 0, out
    rc, out = train_cmd(tmp_path / "crashed", data_dir, *args, env={"FIBJAX_FAULT_AFTER_SAVE": str(n)})
    assert rc == -signal.SIGKILL, out
    assert [s for s, _ in losses(tmp_path / "crashed")] == list(range(1, n + 1))
    rc, out = train_cmd(tmp_path / "crashed", data_dir, *args)
    assert rc == 0 and f"resuming {tmp_path / 'crashed'} from step {n}" in out, out
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "crashed")
    assert resumed == straight  # bit-identical losses, including the data order after the resume
    assert straight[-1][1] < straight[0][1]


@slow
def test_sigterm_saves_and_exits_3_then_resumes_to_the_end(tmp_path, data_dir):
    """Stopped by SIGTERM before its last step, a run saves and exits 3 (not done: a scheduler
    requeues it; 0 would read as finished); the same command then trains to the last step."""
    steps = 300
    proc = train_cmd(tmp_path / "run", data_dir, f"steps={steps}", "checkpoint.every_steps=100000", wait=False)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(tmp_path / "run")) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    assert "stopped by a signal" in out
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and 3 <= saved[-1] < steps
    rc, out = train_cmd(tmp_path / "run", data_dir, f"steps={steps}", "checkpoint.every_steps=100000")
    assert rc == 0 and f"from step {saved[-1]}" in out and f"finished at step {steps}" in out, out
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, steps + 1))


def test_bad_inputs_are_clear_errors_and_overwrite_nothing(tmp_path, data_dir, capsys):
    rc, out = train_main(capsys, tmp_path / "a", tmp_path / "no_such_dir", "steps=2")
    assert rc == 2 and "does not exist" in out
    rc, out = train_main(capsys, tmp_path / "b", data_dir, "steps=2", "model.attention.window=-3")
    assert rc == 2 and "window" in out
    rc, out = train_main(capsys, tmp_path / "b", data_dir, "steps=2", "model.attention.windw=3")
    assert rc == 2 and "windw" in out
    rc, out = train_main(capsys, tmp_path / "c", data_dir, "steps=2")
    assert rc == 0, out
    before = (tmp_path / "c" / "config.json").read_text()
    rc, out = train_main(capsys, tmp_path / "c", data_dir, "steps=2", "model.d_model=64")
    assert rc == 2 and "different config" in out and "model.d_model" in out
    assert (tmp_path / "c" / "config.json").read_text() == before
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    rc, out = train_main(capsys, tmp_path / "d", data_dir, "steps=2")
    assert rc == 2 and "not empty" in out and (tmp_path / "d" / "notes.txt").read_text() == "mine"


def test_corrupt_data_and_tokenizer_mismatch_are_refused(tmp_path, data_dir, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    meta = json.loads((bad / "meta.json").read_text())
    train_bin = bad / next(iter(meta["sources"].values()))["train"]["file"]
    train_bin.write_bytes(train_bin.read_bytes()[:-3])
    rc, out = train_main(capsys, tmp_path / "r1", bad, "steps=2")
    assert rc == 2 and "corrupt" in out
    shutil.rmtree(bad)
    shutil.copytree(data_dir, bad)
    (bad / "tokenizer.model").write_bytes((bad / "tokenizer.model").read_bytes() + b"x")
    rc, out = train_main(capsys, tmp_path / "r2", bad, "steps=2")
    assert rc == 2 and "tokenizer mismatch" in out


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, data_dir, capsys):
    """lr 1e30 makes step 2's gradient NaN; with a save after every step, step 1's checkpoint
    must be on disk, intact and finite, and nothing after it."""
    from fibjax import sharding
    from fibjax.run.checkpoints import Checkpointer
    from fibjax.run.workdir import load_run_config
    from fibjax.train import step

    rc, out = train_main(capsys, tmp_path / "nan", data_dir, "steps=10", "checkpoint.every_steps=1", "optim.lr=1e30", "optim.clip_norm=1e30")
    assert rc == 2 and "the run is stopped" in out, out
    rows = read_metrics(tmp_path / "nan")
    assert rows and all(np.isfinite(r["loss"]) for r in rows)
    good = rows[-1]["step"]  # the last step whose loss and gradient were finite
    saved = sorted(int(p.name) for p in (tmp_path / "nan" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] == good, (saved, good)
    assert f"Last good checkpoint: step {good}" in out
    cfg = load_run_config(tmp_path / "nan")
    trainer = step.build(cfg, sharding.make_mesh(cfg.mesh))
    ckpt = Checkpointer(tmp_path / "nan", cfg.checkpoint)
    state = ckpt.restore(good, trainer.abstract_state)  # raises if its sha256 or finiteness check fails
    ckpt.close()
    assert int(state["step"]) == good


def test_loss_falls_on_real_text(tmp_path, manual_documents):
    """A tiny model learns something from text prepared the way a user's is: gzipped JSON Lines
    files (slices of Python's manual, which every clone has) through ``prepare``, 40 steps."""
    from fibjax.config import TrainConfig, apply_overrides
    from fibjax.data import prepare
    from fibjax.train.loop import train

    for name, docs in [("train", manual_documents[:300]), ("val", manual_documents[300:330])]:
        with gzip.open(tmp_path / f"{name}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    data = tmp_path / "manual"
    prepare(data, {"manual": str(tmp_path / "train.jsonl.gz")}, val={"manual": str(tmp_path / "val.jsonl.gz")}, vocab_size=512, progress=False)
    cfg = apply_overrides(
        TrainConfig(),
        [
            *TINY,
            "model.vocab_size=512",
            "steps=40",
            "optim.lr=3e-3",
            f"data.path={data}",
            "model.attention.kind=offset",
            "model.attention.alpha=staggered",
            "model.attention.window=4",
        ],
    )
    result = train(cfg, tmp_path / "run", progress=False)
    first, last = np.mean(result.losses[:5]), np.mean(result.losses[-5:])
    assert last < first - 1.0, (first, last)


def test_a_save_interrupted_half_way_leaves_the_previous_checkpoint_usable(tmp_path, data_dir, capsys):
    """Orbax writes a step into '<step>.orbax-checkpoint-tmp-*' and renames it when complete: a
    half-written step (as a kill mid-save leaves it) is ignored and the run resumes from the last
    complete one, whose files are untouched."""
    rc, out = train_main(capsys, tmp_path / "run", data_dir, "steps=4", "checkpoint.every_steps=4")
    assert rc == 0, out
    ckpts = tmp_path / "run" / "checkpoints"
    before = {p.relative_to(ckpts): p.read_bytes() for p in (ckpts / "4").rglob("*") if p.is_file()}
    partial = ckpts / "6.orbax-checkpoint-tmp-1234567"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\x00half a checkpoint")
    rc, out = train_main(capsys, tmp_path / "run", data_dir, "steps=6", "checkpoint.every_steps=4")
    assert rc == 0 and "from step 4: the save of step 6 did not finish (the run stopped during it)" in out, out
    assert {p.relative_to(ckpts): p.read_bytes() for p in (ckpts / "4").rglob("*") if p.is_file()} == before
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


def test_data_prepared_again_under_the_same_path_is_refused(tmp_path):
    """A run records its tokenizer; resuming or evaluating with data re-tokenized under the same
    path (other token ids) is an error, not silently wrong numbers."""
    import shutil

    from fibjax.config import TrainConfig, apply_overrides
    from fibjax.data import DataError
    from fibjax.run import load as run_load
    from fibjax.run.workdir import CheckpointError
    from fibjax.train.loop import train

    data = tmp_path / "data"
    prepare_default(data, vocab_size=384)
    cfg = apply_overrides(TrainConfig(), [*TINY, "steps=2", f"data.path={data}"])
    train(cfg, tmp_path / "run", progress=False)
    shutil.rmtree(data)
    prepare_default(data, vocab_size=400)
    with pytest.raises(CheckpointError, match="trained with tokenizer"):
        train(apply_overrides(cfg, ["steps=4"]), tmp_path / "run", progress=False)
    with pytest.raises(DataError, match="tokenizer mismatch"):
        run_load.load_run(tmp_path / "run")


def test_key_value_overrides_are_accepted_anywhere_among_the_flags(tmp_path, data_dir, capsys):
    """``--workdir W steps=3 --no-progress mesh.devices=1`` was refused: argparse took only the
    first run of positional words ("unrecognized arguments: mesh.devices=1")."""
    from fibjax.run.workdir import load_run_config
    from launch.train import DEFAULT_CONFIG, main

    workdir = tmp_path / "run"
    argv = ["--workdir", str(workdir), "steps=2", "--no-progress", *TINY[:4], "--config", str(DEFAULT_CONFIG), *TINY[4:], f"data.path={data_dir}"]
    assert main(argv) == 0, capsys.readouterr()
    cfg = load_run_config(workdir)
    assert (cfg.steps, cfg.model.d_model, cfg.model.vocab_size, cfg.mesh.devices, cfg.data.path) == (2, 32, 384, 1, str(data_dir))
