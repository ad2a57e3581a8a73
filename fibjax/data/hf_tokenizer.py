"""Hugging Face ``tokenizer.json`` files, through the ``tokenizers`` package (Rust; no Python
from the model directory runs). Byte-level BPE (Llama 3, Qwen2, SmolLM) decodes back to the
exact text; so does any tokenizer.json whose normalizer keeps text as is."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import tokenizers

from fibjax.data.special_tokens import read_side_settings, resolve
from fibjax.data.tokenizer_base import HF_FILE, Tokenizer, TokenizerError

# a text the post-processor wraps like any other, to see which special tokens it adds
_PROBE = "a"


class HFTokenizer(Tokenizer, suffix=".json"):
    file_name = HF_FILE

    def __init__(self, file_bytes: bytes, source: str = "<memory>", side: dict | None = None):
        try:
            self._tok = tokenizers.Tokenizer.from_str(file_bytes.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception naming the JSON position
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"{source} is not a valid Hugging Face {HF_FILE}: {first_line}") from None
        # added tokens may sit past the model's vocabulary (not get_vocab: a 128k dict, 0.3 s)
        self._vocab_size = max([self._tok.get_vocab_size(with_added_tokens=False) - 1, *self._tok.get_added_tokens_decoder()]) + 1
        prefix, suffix = self._added_around(_PROBE)
        special = resolve(
            side or {},
            own_bos=prefix[0] if len(prefix) == 1 else None,
            own_eos=suffix[0] if len(suffix) == 1 else None,
            own_add_bos=len(prefix) == 1,
            token_id=self._tok.token_to_id,
            vocab_size=self._vocab_size,
            source=source,
        )
        super().__init__(file_bytes, special, from_side_files=bool(side))

    @classmethod
    def from_file(cls, path: Path) -> HFTokenizer:
        return cls(path.read_bytes(), source=repr(str(path)), side=read_side_settings(path.parent))

    def _added_around(self, text: str) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's post-processor puts before and after a text."""
        plain = self._tok.encode(text, add_special_tokens=False).ids
        wrapped = self._tok.encode(text, add_special_tokens=True).ids
        for start in range(len(wrapped) - len(plain) + 1):
            if wrapped[start : start + len(plain)] == plain:
                return wrapped[:start], wrapped[start + len(plain) :]
        return [], []

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
