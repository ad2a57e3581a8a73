"""Paper A run matrix: fib_fixed_w8 at CPU size."""

from fibjax.recipes import cpu


def get_config():
    return cpu("fib_fixed_w8")
