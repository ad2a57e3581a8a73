"""Paper B: the NSA baseline at CPU size (block 16 x 4 selected blocks, window 31: 32 keys,
half the selection's receptive field, as the reference's 128 keys to 256)."""

import dataclasses

from fibjax.recipes import ssa_cpu


def get_config():
    cfg = ssa_cpu("fullattn")
    attention = dataclasses.replace(cfg.model.attention, kind="nsa", window=31)
    return dataclasses.replace(cfg, name="ssa_cpu_nsa", model=dataclasses.replace(cfg.model, attention=attention))
