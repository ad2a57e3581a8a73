"""fibjax's one tokenizer interface, and ``load_tokenizer`` for every form a tokenizer comes in.

Each implementation subclasses ``Tokenizer`` with the file suffix it reads, which registers it
here, so this module imports neither (``fibjax.data.tokenizer``, the public module, imports both).
Two implementations: a SentencePiece ``.model`` (``sentencepiece_tokenizer.py``: the tokenizers
fibjax trains, and Llama 2 / Mistral style models) and a Hugging Face ``tokenizer.json``
(``hf_tokenizer.py``: Llama 3, Qwen2, SmolLM, ...). ``encode`` never adds special tokens: fibjax
frames every document itself as ``document_start + encode(text) + [eos_id]``, with BOS in
``document_start`` exactly when the source model prepends it (``special_tokens.py``).
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from fibjax.errors import FibjaxError

SENTENCEPIECE_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
# where a Hugging Face model directory names its special tokens, and where ``save`` writes them
TOKENIZER_CONFIG = "tokenizer_config.json"


# file suffix -> the Tokenizer subclass that reads it (filled as the implementations are defined)
_BY_SUFFIX: dict[str, type[Tokenizer]] = {}


class TokenizerError(FibjaxError, ValueError):
    """The tokenizer cannot be trained or loaded; the message says why."""


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None  # None: the tokenizer has no BOS
    eos_id: int  # ends every document in a token file
    add_bos: bool  # the source model begins every document with BOS

    def as_dict(self) -> dict:
        return asdict(self)


class Tokenizer(abc.ABC):
    """A loaded tokenizer: its file's bytes, its special tokens, and the sha256 that ties token
    files to both. ``Tokenizer.load(path)`` is [load_tokenizer][fibjax.data.load_tokenizer].

    An implementation names its file suffix as a class argument (``class X(Tokenizer,
    suffix=".model")``) and provides ``from_file(path)``; ``load_tokenizer`` picks it by suffix.

    Args:
        file_bytes: The tokenizer file's bytes.
        special: Its special tokens.
        from_side_files: Whether ``special`` came from JSON files beside it (then part of its sha256).
    """

    file_name: str  # the name it is saved under, and looked for in a model directory

    def __init_subclass__(cls, suffix: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if suffix is not None:
            _BY_SUFFIX[suffix] = cls

    def __init__(self, file_bytes: bytes, special: SpecialTokens, from_side_files: bool):
        self.file_bytes = file_bytes
        self.special = special
        self.from_side_files = from_side_files
        # The bytes alone name a tokenizer whose special tokens come from its own file (every
        # tokenizer fibjax trained: these shas predate side files and must not change). Settings
        # read from JSON files beside it are part of how its tokens were framed, so they are
        # hashed too, as their resolved ids: the same settings written another way (a token's
        # text in tokenizer_config.json, its id in config.json) give the same sha.
        digest = hashlib.sha256(file_bytes)
        if from_side_files:
            digest.update(b"\n" + json.dumps(special.as_dict(), sort_keys=True).encode())
        self.sha256 = digest.hexdigest()

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer at ``path`` ([load_tokenizer][fibjax.data.load_tokenizer]).

        Args:
            path: A tokenizer file or a model directory.

        Returns:
            The tokenizer.
        """
        return load_tokenizer(path)

    @property
    def bos_id(self) -> int | None:
        return self.special.bos_id

    @property
    def eos_id(self) -> int:
        return self.special.eos_id

    @property
    def add_bos(self) -> bool:
        return self.special.add_bos

    @property
    def document_start(self) -> list[int]:
        """The ids every document begins with, as the source model saw its documents."""
        return [self.special.bos_id] if self.special.add_bos else []

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``directory/file_name`` (and the special-token settings, when they came from side
        files, as ``tokenizer_config.json``) so that loading it gives the same sha256. The
        directory must hold no other tokenizer files. Returns the tokenizer file's path.

        Args:
            directory: Where to write it (created if missing).

        Returns:
            The tokenizer file's path.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.from_side_files:
            settings = {"bos_token": self.token(self.bos_id), "eos_token": self.token(self.eos_id), "add_bos_token": self.add_bos}
            _write_atomically(directory / TOKENIZER_CONFIG, (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode())
        _write_atomically(directory / self.file_name, self.file_bytes)
        return directory / self.file_name

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """One past the largest id (every id in a token file is below it)."""

    @abc.abstractmethod
    def token(self, token_id: int | None) -> str | None:
        """The text of a token (None for None).

        Args:
            token_id: An id, or None.

        Returns:
            The token's text, or None.
        """

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, without special tokens.

        Args:
            text: The text.

        Returns:
            The ids.
        """

    @abc.abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of many documents at once (spread over threads).

        Args:
            texts: The documents.

        Returns:
            The ids of each.
        """

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``.

        Args:
            ids: Token ids.

        Returns:
            The text.
        """


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A SentencePiece ``.model``, a Hugging Face ``tokenizer.json``, or a model directory holding
    either (``tokenizer.json`` preferred). JSON files beside the tokenizer file (a Hugging Face
    model directory's) say which special tokens the source model uses; they are only read.

    Args:
        path: A ``.model`` file, a ``tokenizer.json`` or a directory holding either.

    Returns:
        The tokenizer.

    Raises:
        TokenizerError: No such path, or not a tokenizer file or directory.
    """
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in (HF_FILE, SENTENCEPIECE_FILE) if (path / name).is_file()]
        if not found:
            raise TokenizerError(f"{str(path)!r} holds neither {HF_FILE} nor {SENTENCEPIECE_FILE}: it is not a tokenizer or Hugging Face model directory")
        path = found[0]
    if not path.is_file():
        raise TokenizerError(f"tokenizer {str(path)!r} does not exist")
    if path.suffix not in _BY_SUFFIX:
        raise TokenizerError(f"tokenizer {str(path)!r}: expected a SentencePiece .model, a {HF_FILE} or a Hugging Face model directory")
    return _BY_SUFFIX[path.suffix].from_file(path)
