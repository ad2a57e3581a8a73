"""Moved to ``fibjax.run.lock``; this path still works, with a DeprecationWarning on use."""

from fibjax._moved import forward_to

__getattr__ = forward_to(__name__, "fibjax.run.lock")
