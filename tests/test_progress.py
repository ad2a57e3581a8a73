"""What a run shows while it trains: "compiling" before step 1, a progress bar whose rate and
ETA leave compilation out and whose last line is drawn once, the validation curve (in
metrics.jsonl and on the bar), and the end-of-run line on how the model fits held-out text."""

import re

from fibjax.config import TrainConfig, apply_overrides, load_config_file
from fibjax.train.loop import train
from fibjax.train.metrics import RISE_NATS, fit_summary, read_metrics
from tests.helpers import ROOT, TINY


def test_the_bar_starts_after_compiling_ends_once_and_shows_validation(tmp_path, data_dir, capsys):
    cfg = apply_overrides(TrainConfig(), [*TINY, "steps=6", "log_every=3", "eval.every_steps=3", f"data.path={data_dir}"])
    train(cfg, tmp_path / "run", progress=True)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == "compiling the training step (step 1 runs once it is compiled) ...", out
    assert re.fullmatch(r"compiled; step 1 done in \d+\.\d s", lines[1]), out
    frames = [f.strip() for f in re.split(r"[\r\n]", err) if "step" in f]
    counts = [re.search(r"(\d+)/6 \[", f).group(1) for f in frames]
    # no frame before step 1 is done (its time would be compilation's), and the last one drawn once
    assert counts[0] == "1" and "0" not in counts and counts.count("6") == 1, frames
    rows = read_metrics(tmp_path / "run")
    val = [(r["step"], r["val/python_docs"]) for r in rows if "val/python_docs" in r]
    assert [s for s, _ in val] == [3, 6]
    assert f"loss={rows[-2]['loss']:.4f}" in frames[-1] and f"val={val[-1][1]:.4f}" in frames[-1], (frames[-1], rows[-2:])
    assert lines[-1] == fit_summary(rows, last=3) and lines[-1].startswith("fit at step 6: training loss"), out


def _rows(val_by_step: dict[int, float], loss: float = 2.0) -> list[dict]:
    rows = []
    for step in range(1, max(val_by_step) + 1):
        rows.append({"step": step, "loss": loss})
        if step in val_by_step:
            rows.append({"step": step, "val/docs": val_by_step[step]})
    return rows


def test_fit_summary_says_the_gap_and_when_validation_rises():
    rising = fit_summary(_rows({10: 4.0, 20: 3.5, 30: 3.9}, loss=1.0), last=10)
    assert "training loss 1.000 (mean of the last 10 steps), validation NLL 3.900 (docs; perplexity 49.4), a gap of +2.900" in rising
    assert "warning: the validation NLL was lowest at step 20 (3.500) and has risen 0.400 since: the model is memorising" in rising
    assert "lowest so far" in fit_summary(_rows({10: 4.0, 20: 3.5}), last=10)
    near = fit_summary(_rows({10: 4.0, 20: 3.5, 30: 3.5 + RISE_NATS / 2}), last=10)
    assert "warning" not in near and "within 0.02 of its lowest (3.500 at step 20)" in near
    two_sources = [{"step": 1, "loss": 2.0}, {"step": 1, "val/docs": 4.0, "val/web": 5.0}]  # one row per validation, as the loop writes
    assert "validation NLL 4.500 (docs, web: their mean; perplexity 90.0)" in fit_summary(two_sources, last=5)
    ssa = [{"step": 1, "loss": 9.0, "ce": 3.0}, {"step": 1, "val/docs": 3.0}]
    assert "training loss 3.000" in fit_summary(ssa, last=5)  # the cross-entropy, not CE + alignment
    assert fit_summary([{"step": 1, "loss": 2.0}], last=5) is None  # no validation curve: nothing to say


def test_the_tiny_default_logs_a_validation_curve():
    cfg = load_config_file(str(ROOT / "configs" / "tiny.py"))
    assert 0 < cfg.eval.every_steps < cfg.steps and cfg.steps % cfg.eval.every_steps == 0
