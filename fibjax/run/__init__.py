"""fibjax.run: a run directory, the one place that knows its layout.

```
RUN/config.json              the resolved TrainConfig (compared on every resume)   workdir.py
RUN/tokenizer.sha256         the tokenizer the run started with (data must keep it) workdir.py
RUN/data/                    the embedded corpus, prepared here when data.path is empty  workdir.py
RUN/fibjax.lock              held by the run training in it                        lock.py
RUN/checkpoints/<step>/      Orbax state + data-iterator position + checksums      checkpoints.py, integrity.py
RUN/checkpoints.set_aside/   the steps after a --resume-step (kept, not deleted)   checkpoints.py
RUN/metrics.jsonl            a row per step and per validation (its curve keys)     curves.py
```

``load.py`` loads a run's parameters and tokenizer for evaluation and decoding. Training
(``fibjax.train``), evaluation (``fibjax.eval``) and decoding (``fibjax.decode``) all sit on
top of this package; it imports none of them. Importing the package loads nothing (reading a
run's config does not load Orbax or JAX); its names load their module when first used.
"""

from typing import TYPE_CHECKING

from fibjax._exports import lazy_exports

if TYPE_CHECKING:
    from fibjax.run.checkpoints import Checkpointer, DamagedCheckpoint
    from fibjax.run.load import LoadedRun, load_run
    from fibjax.run.lock import WorkdirInUse, WorkdirLock
    from fibjax.run.workdir import CheckpointError, load_run_config

_HOMES = {
    "Checkpointer": "fibjax.run.checkpoints",
    "DamagedCheckpoint": "fibjax.run.checkpoints",
    "LoadedRun": "fibjax.run.load",
    "load_run": "fibjax.run.load",
    "WorkdirInUse": "fibjax.run.lock",
    "WorkdirLock": "fibjax.run.lock",
    "CheckpointError": "fibjax.run.workdir",
    "load_run_config": "fibjax.run.workdir",
}
# the same names as _HOMES (tests/test_public_api.py)
__all__ = ["CheckpointError", "Checkpointer", "DamagedCheckpoint", "LoadedRun", "WorkdirInUse", "WorkdirLock", "load_run", "load_run_config"]
__getattr__ = lazy_exports(__name__, _HOMES)
