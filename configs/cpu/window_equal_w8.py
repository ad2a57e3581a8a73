"""Baseline at equal cost: a sliding window with as many keys per query as fib_stagger_w8 at CPU size.

fib_stagger_w8 at seq 256 attends, per layer (alpha 0.5 .. 1.5), the dense window {0..8} plus the
rungs within the cap of 255: 15, 15, 16, 16, 17, 16, 16, 16 keys (its kind's ``attended()``),
mean 15.875; rounded, W = 16: each query attends its last 16 keys, itself included
(``tests/test_window.py`` recounts them). Otherwise the CPU recipe of ``dense``.
"""

import dataclasses

from fibjax.config import AttentionConfig
from fibjax.recipes import cpu

WINDOW = 16


def get_config():
    base = cpu("dense")
    model = dataclasses.replace(base.model, attention=AttentionConfig(kind="window", window=WINDOW))
    return dataclasses.replace(base, name="cpu_window_equal_w8", model=model)
