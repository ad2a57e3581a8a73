"""The tokenizer's public module: the interface and ``load_tokenizer`` (``tokenizer_base.py``),
and the two implementations it loads, imported here so that both are registered.

``encode`` never adds special tokens: fibjax frames every document itself as
``document_start + encode(text) + [eos_id]`` (``special_tokens.py``).
"""

from fibjax.data.hf_tokenizer import HFTokenizer
from fibjax.data.sentencepiece_tokenizer import SentencePieceTokenizer
from fibjax.data.tokenizer_base import HF_FILE, SENTENCEPIECE_FILE, TOKENIZER_CONFIG, SpecialTokens, Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "HF_FILE",
    "SENTENCEPIECE_FILE",
    "TOKENIZER_CONFIG",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "SpecialTokens",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]
