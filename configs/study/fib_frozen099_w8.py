"""The interpolation control (BUILD_NOTES, "The interpolation control"): fib_learned_w8's
interpolated path with alpha frozen at 0.99 in every layer (a fractional rung scale near the
learned runs' 0.988-1.016, never moved by the optimizer). Not one of paper A's models."""

import dataclasses

from fibjax.recipes import cpu


def get_config():
    cfg = cpu("fib_learned_w8")
    attention = dataclasses.replace(cfg.model.attention, alpha=(0.99,) * cfg.model.num_layers, learn_alpha=True)
    model = dataclasses.replace(cfg.model, attention=attention)
    return dataclasses.replace(cfg, name="cpu_fib_frozen099_w8", model=model, optim=dataclasses.replace(cfg.optim, alpha_lr_multiplier=0.0))
