"""Paper B: fullattn at the paper's Llama-3.2-1B shape."""

from fibjax.recipes import ssa_paper


def get_config():
    return ssa_paper("fullattn")
