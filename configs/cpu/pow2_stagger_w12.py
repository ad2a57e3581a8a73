"""Paper A run matrix: pow2_stagger_w12 at CPU size."""

from fibjax.recipes import cpu


def get_config():
    return cpu("pow2_stagger_w12")
