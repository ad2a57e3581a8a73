"""Paper A run matrix: fib_stagger_w8 at the paper's size and recipe."""

from fibjax.recipes import paper


def get_config():
    return paper("fib_stagger_w8")
