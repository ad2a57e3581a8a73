"""Paper B: moba at CPU size."""

from fibjax.recipes import ssa_cpu


def get_config():
    return ssa_cpu("moba")
