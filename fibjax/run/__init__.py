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
top of this package; it imports none of them. Import the modules themselves (this package
imports nothing, so reading a run's config does not load Orbax or JAX).
"""
