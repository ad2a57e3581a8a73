"""Paper B: ssa_fib at CPU size."""

from fibjax.recipes import ssa_cpu


def get_config():
    return ssa_cpu("ssa_fib")
