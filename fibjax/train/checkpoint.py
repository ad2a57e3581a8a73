"""Moved to [fibjax.run][fibjax.run] (``checkpoints``, ``integrity``, ``failures``, ``workdir``); this
path still works, with a DeprecationWarning on use naming each name's new module."""

from fibjax._moved import forward_to

__getattr__ = forward_to(__name__, "fibjax.run.lock", "fibjax.run.workdir", "fibjax.run.integrity", "fibjax.run.failures", "fibjax.run.checkpoints")
