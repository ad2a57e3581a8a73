"""Tokens to text, one token at a time, for printing while generating.

SentencePiece drops the leading space of the first piece it decodes, and a character made of
byte-fallback pieces is only complete after its last byte, so a token cannot be decoded on its
own. The streamer decodes a short window that starts a little before the unprinted tokens and
emits what the window gained, holding it back while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fibjax.data.tokenizer_base import Tokenizer

_CONTEXT = 4  # tokens before the unprinted ones that every window re-decodes


class TextStreamer:
    """``push(token) -> new text`` after a prompt; ``finish()`` returns whatever is held back.

    Args:
        tokenizer: The tokenizer whose ``decode`` gives the text.
        prompt_ids: The prompt's ids (their text is not returned).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]):
        self._decode = tokenizer.decode
        self._ids = [int(i) for i in prompt_ids]
        self._read = len(self._ids)  # tokens whose text is already out
        self._start = max(self._read - _CONTEXT, 0)  # where the window starts

    def _gained(self) -> str:
        printed = self._decode(self._ids[self._start : self._read])
        return self._decode(self._ids[self._start :])[len(printed) :]

    def push(self, token: int) -> str:
        """The text ``token`` completes, or "" while it ends inside a multi-byte character.

        Args:
            token: The next token id.

        Returns:
            The new text.
        """
        self._ids.append(int(token))
        text = self._gained()
        if not text or text.endswith("\ufffd"):
            return ""
        self._start, self._read = max(len(self._ids) - _CONTEXT, 0), len(self._ids)
        return text

    def finish(self) -> str:
        """The text held back after the last token (an incomplete character's replacement).

        Returns:
            The remaining text.
        """
        text = self._gained()
        self._start = self._read = len(self._ids)
        return text
