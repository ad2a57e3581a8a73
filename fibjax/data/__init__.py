"""Data: tokenizer, document sources, corpus preparation, and the Grain input pipeline."""

from fibjax.data.pipeline import mixture_weights, train_iterator
from fibjax.data.prepare import prepare, prepare_default
from fibjax.data.sentencepiece_tokenizer import train_tokenizer
from fibjax.data.sources import DataError
from fibjax.data.token_files import load_meta, validation_sources, validation_tokens
from fibjax.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "DataError",
    "Tokenizer",
    "TokenizerError",
    "load_meta",
    "load_tokenizer",
    "mixture_weights",
    "prepare",
    "prepare_default",
    "train_iterator",
    "train_tokenizer",
    "validation_sources",
    "validation_tokens",
]
