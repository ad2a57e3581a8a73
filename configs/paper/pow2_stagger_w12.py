"""Paper A run matrix: pow2_stagger_w12 at the paper's size and recipe."""

from fibjax.recipes import paper


def get_config():
    return paper("pow2_stagger_w12")
