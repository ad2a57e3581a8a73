"""Paper A run matrix: dense at the paper's size and recipe."""

from fibjax.recipes import paper


def get_config():
    return paper("dense")
