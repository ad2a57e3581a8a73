"""Paper A run matrix: dense at CPU size."""

from fibjax.recipes import cpu


def get_config():
    return cpu("dense")
