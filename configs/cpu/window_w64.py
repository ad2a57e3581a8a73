"""The "more keys" reference: a sliding window of 64 keys per query (4x fib_stagger_w8's 16 at
seq 256; ``window_equal_w8.py`` has the count). Otherwise the CPU recipe of ``dense``."""

import dataclasses

from fibjax.config import AttentionConfig
from fibjax.recipes import cpu

WINDOW = 64


def get_config():
    base = cpu("dense")
    model = dataclasses.replace(base.model, attention=AttentionConfig(kind="window", window=WINDOW))
    return dataclasses.replace(base, name="cpu_window_w64", model=model)
