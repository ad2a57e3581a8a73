"""Tokens to text, one token at a time, for printing while generating.

SentencePiece drops the leading space of the first piece it decodes, and a character made of
byte-fallback pieces is only complete after its last byte, so a token cannot be decoded on its
own. The streamer decodes a short window that starts a little before the unprinted tokens and
emits what the window gained, holding it back while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence

_CONTEXT = 4  # tokens before the unprinted ones that every window re-decodes


class TextStreamer:
    """``push(token) -> new text`` after a prompt; ``finish()`` returns whatever is held back."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int]):
        self._decode = tokenizer.decode
        self._ids = [int(i) for i in prompt_ids]
        self._read = len(self._ids)  # tokens whose text is already out
        self._start = max(self._read - _CONTEXT, 0)  # where the window starts

    def _gained(self) -> str:
        printed = self._decode(self._ids[self._start : self._read])
        return self._decode(self._ids[self._start :])[len(printed) :]

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        text = self._gained()
        if not text or text.endswith("\ufffd"):
            return ""
        self._start, self._read = max(len(self._ids) - _CONTEXT, 0), len(self._ids)
        return text

    def finish(self) -> str:
        text = self._gained()
        self._start = self._read = len(self._ids)
        return text
