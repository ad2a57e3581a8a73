"""Paper B: the NSA baseline at the paper's Llama-3.2-1B shape: block 16 x 16 selected blocks and
window 127 (the keys i-127 .. i: the reference's window_size 128), as zhenyi4/ssa's nsa-1b config."""

import dataclasses

from fibjax.recipes import ssa_paper


def get_config():
    cfg = ssa_paper("fullattn")
    attention = dataclasses.replace(cfg.model.attention, kind="nsa", window=127)
    return dataclasses.replace(cfg, name="ssa_paper_nsa", model=dataclasses.replace(cfg.model, attention=attention))
