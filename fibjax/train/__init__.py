"""Training: optimizer, sharding, checkpointing, the step and the loop.

Importing the package loads nothing; its names load their module (and JAX) when first used.
"""

from typing import TYPE_CHECKING

from fibjax._exports import lazy_exports

if TYPE_CHECKING:
    from fibjax.train.loop import NonFiniteLoss, RunResult, train
    from fibjax.train.optimizer import lr_schedule, make_optimizer
    from fibjax.train.step import Trainer, build

_HOMES = {
    "NonFiniteLoss": "fibjax.train.loop",
    "RunResult": "fibjax.train.loop",
    "train": "fibjax.train.loop",
    "lr_schedule": "fibjax.train.optimizer",
    "make_optimizer": "fibjax.train.optimizer",
    "Trainer": "fibjax.train.step",
    "build": "fibjax.train.step",
}
# the same names as _HOMES (tests/test_public_api.py)
__all__ = ["NonFiniteLoss", "RunResult", "Trainer", "build", "lr_schedule", "make_optimizer", "train"]
__getattr__ = lazy_exports(__name__, _HOMES)
