"""SentencePiece tokenizers: a given ``.model`` (Llama 2, Mistral), or one fibjax trains.

Training follows the Llama recipe so that ``decode(encode(text)) == text`` for any text:
identity normalization, whitespace kept as is, digits split, and byte fallback (a character
the vocabulary lacks becomes its UTF-8 bytes, so nothing is ever ``<unk>``). Ids 0 and 1 are
``<unk>`` and ``</s>`` (EOS, written between documents); there is no BOS or pad piece.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from fibjax.data.special_tokens import read_side_settings, resolve
from fibjax.data.tokenizer_base import SENTENCEPIECE_FILE, Tokenizer, TokenizerError

# 256 byte-fallback pieces + <unk> + </s>; every other piece is a character or a merge.
NUM_RESERVED_PIECES = 258
# Lines longer than this are cut into pieces for training (SentencePiece skips, silently,
# any training "sentence" longer than its max_sentence_length).
_MAX_TRAIN_LINE_BYTES = 8192


class SentencePieceTokenizer(Tokenizer, suffix=".model"):
    """A SentencePiece model. Its own BOS, when it has one, begins every document: a model with a
    BOS piece was trained with it in front (transformers' Llama tokenizers default to
    add_bos_token); the ones fibjax trains have none."""

    file_name = SENTENCEPIECE_FILE

    def __init__(self, model_bytes: bytes, source: str = "<memory>", side: dict | None = None):
        self._processor = spm.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(model_bytes)
        except Exception as e:  # SentencePiece raises RuntimeError/OSError with a terse text
            raise TokenizerError(f"{source} is not a valid SentencePiece model: {e}") from None
        own_bos, own_eos = self._processor.bos_id(), self._processor.eos_id()
        special = resolve(
            side or {},
            own_bos=own_bos if own_bos >= 0 else None,
            own_eos=own_eos if own_eos >= 0 else None,
            own_add_bos=own_bos >= 0,
            token_id=self._piece_id,
            vocab_size=self.vocab_size,
            source=source,
        )
        super().__init__(model_bytes, special, from_side_files=bool(side))

    @classmethod
    def from_file(cls, path: Path) -> SentencePieceTokenizer:
        return cls(path.read_bytes(), source=repr(str(path)), side=read_side_settings(path.parent))

    @property
    def model_bytes(self) -> bytes:
        return self.file_bytes

    def _piece_id(self, piece: str) -> int | None:
        found = self._processor.piece_to_id(piece)
        return found if self._processor.id_to_piece(found) == piece else None

    @property
    def vocab_size(self) -> int:
        return self._processor.vocab_size()

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._processor.id_to_piece(token_id)

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        return self._processor.encode(texts, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self._processor.decode([int(i) for i in ids])


def _training_lines(texts: Iterable[str]) -> Iterator[str]:
    """Documents -> non-empty lines, long lines cut at whitespace near the byte limit."""
    for text in texts:
        for line in text.split("\n"):
            while len(line.encode("utf-8")) > _MAX_TRAIN_LINE_BYTES:
                head = line[: _MAX_TRAIN_LINE_BYTES // 4]  # <= 4 bytes per character
                cut = head.rfind(" ") if " " in head[1:] else len(head)
                yield head[: max(cut, 1)]
                line = line[max(cut, 1) :]
            if line.strip():
                yield line


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, num_threads: int = 2) -> SentencePieceTokenizer:  # noqa: DOC503
    """Train a BPE model on ``texts`` (documents). Deterministic: the same texts in the same
    order give the same model bytes (no sampling of the input; fixed thread count).

    Args:
        texts: The training documents.
        vocab_size: The vocabulary size (more than the 258 reserved pieces).
        num_threads: SentencePiece's threads (fixed, for determinism).

    Returns:
        The trained tokenizer.

    Raises:
        TokenizerError: A vocabulary too small, no text, or SentencePiece's training failing.
    """
    if vocab_size <= NUM_RESERVED_PIECES:
        raise TokenizerError(f"vocab_size must exceed {NUM_RESERVED_PIECES} (256 byte pieces + <unk> + </s>), got {vocab_size}")
    lines = _training_lines(texts)
    first = next(lines, None)
    if first is None:
        raise TokenizerError("cannot train a tokenizer on empty text (no non-blank line in the training documents)")
    model = io.BytesIO()
    reading_failed: list[Exception] = []  # SentencePiece turns an iterator's exception into a terse RuntimeError

    def all_lines():
        try:
            yield first
            yield from lines
        except Exception as e:
            reading_failed.append(e)
            raise

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_lines(),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            unk_id=0,
            eos_id=1,
            bos_id=-1,
            pad_id=-1,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9995,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=_MAX_TRAIN_LINE_BYTES,
            hard_vocab_limit=False,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as e:
        if reading_failed:
            raise reading_failed[0] from None
        message = str(e)
        needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
        if needed:
            raise TokenizerError(
                f"vocab_size {vocab_size} is too small for this text: it needs at least {needed.group(1)} "
                f"({NUM_RESERVED_PIECES} byte/special pieces + the characters covering 99.95% of the text)"
            ) from None
        raise TokenizerError(f"SentencePiece training failed: {message}") from None
    tokenizer = SentencePieceTokenizer(model.getvalue())
    if tokenizer.vocab_size != vocab_size:
        raise TokenizerError(
            f"the training text supports only {tokenizer.vocab_size} BPE pieces, fewer than vocab_size {vocab_size}; use more text or a smaller vocab_size"
        )
    return tokenizer
