"""Paper A run matrix: pow2_fixed_w8 at the paper's size and recipe."""

from fibjax.recipes import paper


def get_config():
    return paper("pow2_fixed_w8")
