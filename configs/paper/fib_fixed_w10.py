"""Paper A run matrix: fib_fixed_w10 at the paper's size and recipe."""

from fibjax.recipes import paper


def get_config():
    return paper("fib_fixed_w10")
