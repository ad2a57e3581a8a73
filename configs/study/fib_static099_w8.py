"""Shifted or soft (BUILD_NOTES, "Shifted or soft: declared before its runs"): fixed W8's static
(rounded) path with alpha 0.99 in every layer. Its rungs land at round(0.99 f): 54, 88, 143 and
231 instead of 55, 89, 144 and 233 (13, 21 and 34 unchanged), one key each, 16 keys per query like
fixed. Against the interpolation control (``fib_frozen099_w8``: the same alpha on the interpolated
path, each rung blended over two neighbouring keys) it separates "the rungs moved" from "the rungs
are soft". Not one of paper A's models."""

import dataclasses

from fibjax.recipes import cpu


def get_config():
    cfg = cpu("fib_fixed_w8")
    attention = dataclasses.replace(cfg.model.attention, alpha=(0.99,) * cfg.model.num_layers)
    model = dataclasses.replace(cfg.model, attention=attention)
    return dataclasses.replace(cfg, name="cpu_fib_static099_w8", model=model)
