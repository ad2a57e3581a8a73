"""Paper A run matrix: fib_coprime_w12 at CPU size."""

from fibjax.recipes import cpu


def get_config():
    return cpu("fib_coprime_w12")
