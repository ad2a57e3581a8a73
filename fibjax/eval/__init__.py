"""Evaluation: perplexity by length and position, checkpoint loading, reports."""
