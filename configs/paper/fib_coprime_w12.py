"""Paper A run matrix: fib_coprime_w12 at the paper's size and recipe."""

from fibjax.recipes import paper


def get_config():
    return paper("fib_coprime_w12")
