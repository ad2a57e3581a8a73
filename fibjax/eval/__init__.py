"""Evaluation: perplexity by length and position, checkpoint loading, reports.

Importing the package loads nothing; its names load their module (and JAX) when first used.
"""

from typing import TYPE_CHECKING

from fibjax._exports import lazy_exports

if TYPE_CHECKING:
    from fibjax.eval.perplexity import EvalError, LengthResult, evaluate_lengths
    from fibjax.eval.runner import ReportNotWritten, evaluate_run, evaluate_workdir, format_table, write_report

_HOMES = {
    "EvalError": "fibjax.eval.perplexity",
    "LengthResult": "fibjax.eval.perplexity",
    "evaluate_lengths": "fibjax.eval.perplexity",
    "ReportNotWritten": "fibjax.eval.runner",
    "evaluate_run": "fibjax.eval.runner",
    "evaluate_workdir": "fibjax.eval.runner",
    "format_table": "fibjax.eval.runner",
    "write_report": "fibjax.eval.runner",
}
# the same names as _HOMES (tests/test_public_api.py)
__all__ = ["EvalError", "LengthResult", "ReportNotWritten", "evaluate_lengths", "evaluate_run", "evaluate_workdir", "format_table", "write_report"]
__getattr__ = lazy_exports(__name__, _HOMES)
