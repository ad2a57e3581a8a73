"""Metrics as JSON Lines and TensorBoard events, written by process 0 only.

``metrics.jsonl`` is appended one line per row. A crash or a full disk can cut its last line
short: readers ignore such a torn tail, and a resumed run drops it with a warning. On resume the
file is rewritten (rows after the checkpoint are dropped) through a temporary file and
``os.replace``, so a kill at that moment leaves the old file or the new one, never a part. A
failed write (a full disk), here or in tensorboardX's writer thread, is raised by ``write``
on the main thread as an OSError naming the file, so the loop can stop with one line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from pathlib import Path

import jax

from fibjax.errors import FibjaxError
from fibjax.run.curves import METRICS_FILE, curve_values

# A validation NLL this far above its best is overfitting, not noise: the curve scores the same
# held-out windows every time, so it moves only with the weights.
RISE_NATS = 0.02


# OSErrors of tensorboardX's writer thread, for the main thread to raise (see _keep_tensorboard_errors)
_TENSORBOARD_ERRORS: list[OSError] = []


def _keep_tensorboard_errors() -> None:
    """An OSError that kills tensorboardX's writer thread (a full disk) is kept for
    MetricsWriter.write to raise on the main thread, not printed from the thread as a traceback."""
    previous = threading.excepthook
    if getattr(previous, "keeps_tensorboard_errors", False):
        return

    def hook(args):
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboardX"):
            _TENSORBOARD_ERRORS.append(args.exc_value)
        else:
            previous(args)

    hook.keeps_tensorboard_errors = True
    threading.excepthook = hook


class MetricsError(FibjaxError, ValueError):
    """metrics.jsonl holds a damaged line that is not its last (a crash only tears the last)."""


def _rows(path: Path) -> tuple[list[tuple[str, dict]], str | None]:
    """(line, row) for every complete line of ``path``, and the torn last line if there is one."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append((line, row))
        elif i == len(lines) - 1:
            return rows, line
        else:
            raise MetricsError(
                f"{path}, line {i + 1}, is not a metrics row ({line[:40]!r}...); move the file aside "
                "(it holds only logged metrics) and run the same command again"
            )
    return rows, None


class MetricsWriter:
    def __init__(self, workdir: Path, *, resume_step: int = 0, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = Path(workdir) / METRICS_FILE
        self._tb = None
        if not self.enabled:
            return
        if self.path.exists():
            self._keep_rows_until(resume_step)
        self._file = self.path.open("a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"))
            _keep_tensorboard_errors()

    def _keep_rows_until(self, resume_step: int) -> None:
        """Drop the rows logged after the checkpoint we resume from, and a torn last line."""
        rows, torn = _rows(self.path)
        if torn is not None:
            print(f"warning: {self.path}: dropped its last line, cut short by a crash or a full disk ({torn[:40]!r}...)", file=sys.stderr)
        kept = "".join(line + "\n" for line, row in rows if row.get("step", 0) <= resume_step)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(kept)
        os.replace(tmp, self.path)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        if _TENSORBOARD_ERRORS:
            e = _TENSORBOARD_ERRORS.pop()
            raise OSError(e.errno, e.strerror, self._tb.logdir) from None
        try:
            self._file.write(json.dumps({"step": step, **scalars}) + "\n")
        except OSError as e:  # the file object's error does not name the file
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if not self.enabled:
            return
        try:
            self._file.close()
        finally:
            if self._tb is not None:
                self._close_tensorboard()

    def _close_tensorboard(self) -> None:
        try:
            self._tb.close()
        except OSError:
            # A full disk: the pending events are lost either way. Mark the writers closed, or
            # tensorboardX retries at exit and prints a traceback after our one-line error.
            for writer in (self._tb.all_writers or {}).values():
                writer.event_writer._closed = True
            raise


def read_metrics(workdir: Path) -> list[dict]:
    """The rows of ``RUN/metrics.jsonl`` ([] if none). A torn last line, as a crash leaves or
    a running job has half-written, is not a row."""
    path = Path(workdir) / METRICS_FILE
    return [row for _, row in _rows(path)[0]] if path.exists() else []


def fit_summary(rows: list[dict], *, last: int) -> str | None:
    """One line on how well the model does on text it did not train on: the training loss (mean
    of the last ``last`` rows), the latest validation NLL (mean over the validation sources), the
    gap between them, and whether the validation NLL has risen from its best: the sign that the
    model is memorising its training text. None when the run logged no validation curve."""
    val_rows = [(r["step"], curve_values(r)) for r in rows]
    val_rows = [(step, nll) for step, nll in val_rows if nll]
    train = [r.get("ce", r["loss"]) for r in rows if "loss" in r][-last:]  # an SSA run's "loss" adds its alignment term
    if not val_rows or not train:
        return None
    curve = [(step, sum(nll.values()) / len(nll)) for step, nll in val_rows]
    (step, final), (best_step, best) = curve[-1], min(curve, key=lambda c: c[1])
    train_loss = sum(train) / len(train)
    sources = ", ".join(val_rows[-1][1])
    line = (
        f"fit at step {step}: training loss {train_loss:.3f} (mean of the last {len(train)} steps), validation NLL {final:.3f} "
        f"({sources}{': their mean' if len(val_rows[-1][1]) > 1 else ''}; perplexity {math.exp(final):,.1f}), "
        f"a gap of {final - train_loss:+.3f} nats per token"
    )
    if final - best > RISE_NATS:
        return (
            f"{line}; warning: the validation NLL was lowest at step {best_step} ({best:.3f}) and has risen {final - best:.3f} since: "
            "the model is memorising its training text (train fewer steps, or on more text)"
        )
    if best_step == step:
        return f"{line}; the validation NLL is at its lowest so far"
    return f"{line}; the validation NLL is within {RISE_NATS} of its lowest ({best:.3f} at step {best_step})"
