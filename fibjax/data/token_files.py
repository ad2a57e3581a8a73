"""The prepared-data directory: flat token files and the ``meta.json`` that vouches for them.

Layout written by ``fibjax.data.prepare``::

    DIR/tokenizer.model         the tokenizer every token file was encoded with: a SentencePiece
      or DIR/tokenizer.json     model or a Hugging Face tokenizer.json (meta.json names which),
    [DIR/tokenizer_config.json] with the special-token settings it came with, if any
    DIR/<source>/train.bin      tokens of every document: [BOS if the tokenizer's model uses it] ids EOS
    DIR/<source>/val.bin        the same for the validation split
    DIR/meta.json               counts, dtype, tokenizer file, sha256 and special ids, inputs,
                                fingerprint, and the sha256 of every token file

Files are raw little-endian uint16 (vocab <= 65536) or uint32, read back as memmaps. Reading
checks what a reader can check cheaply: the tokenizer's hash, every file's exact size, and
(when a file is opened for training or evaluation) that every token id is in the vocabulary.
A token id changed to another id in range passes all of these: ``verify_checksums`` compares
each file with the sha256 meta.json records for it, once per run (``fibjax.run.workdir``
records what it verified, so a resume does not hash the data again).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from fibjax.data.sources import DataError
from fibjax.data.special_tokens import SIDE_FILES
from fibjax.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer

META_FILE = "meta.json"
# the tokenizer file of a directory whose meta.json names none (prepared before tokenizer.json)
TOKENIZER_FILE = "tokenizer.model"
FORMAT_VERSION = 1
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def split_file(name: str, split: str) -> str:
    """Path of a token file relative to the data directory."""
    return f"{name}/{split}.bin"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomically(path: Path, data: dict) -> None:
    """``path`` replaced whole by ``data``, through a temporary file of its own (two writers never share one)."""
    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=f".{Path(path).name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a run's records from the other users of a shared disk
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def free_space(path: str | os.PathLike) -> str:
    """Free space on the filesystem holding ``path`` (or its nearest existing parent), for
    the error message of a failed write."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return human_bytes(shutil.disk_usage(path).free)


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def read_meta_file(data_dir: Path) -> dict | None:
    """meta.json as written, or None when the directory holds none (not prepared yet)."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is unreadable ({e}); delete the directory and prepare it again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise DataError(f"{path} is not fibjax prepared-data metadata of format {FORMAT_VERSION}; prepare the data again")
    return meta


def tokenizer_path(data_dir: str | os.PathLike, meta: dict | None = None) -> Path:
    """The tokenizer file of a prepared directory (``meta`` read from it when not given)."""
    data_dir = Path(data_dir)
    meta = meta if meta is not None else read_meta_file(data_dir)
    return data_dir / (meta or {}).get("tokenizer", {}).get("file", TOKENIZER_FILE)


def data_tokenizer(data_dir: str | os.PathLike, meta: dict | None = None) -> Tokenizer:
    """The tokenizer the token files of ``data_dir`` were made with."""
    return load_tokenizer(tokenizer_path(data_dir, meta))


def load_meta(data_dir: str | os.PathLike, *, tokenizer_sha256: str | None = None) -> dict:
    """Read and check ``DIR/meta.json``: the tokenizer file is the one the tokens were made
    with (and ``tokenizer_sha256`` when given, e.g. the one a checkpoint recorded), and every
    token file has exactly the size its token count says.

    Args:
        data_dir: The prepared data.
        tokenizer_sha256: The sha256 the tokenizer must have (None: not checked).

    Returns:
        The ``meta.json`` contents.

    Raises:
        DataError: No ``meta.json``, a missing or different tokenizer, or a token file of the wrong
            size.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(
            f"data directory {str(data_dir)!r} does not exist; prepare it with python -m launch.prepare_data --out {data_dir} "
            "--source NAME=FILES_OR_hf:DATASET (one --source per corpus; docs/guides/your-own-data.md)"
        )
    meta = read_meta_file(data_dir)
    if meta is None:
        raise DataError(f"{str(data_dir)!r} holds no {META_FILE}: it was never prepared, or preparation did not finish")
    recorded = meta["tokenizer"]["sha256"]
    path = tokenizer_path(data_dir, meta)
    if not path.is_file():
        raise DataError(f"{path} is missing; the token files cannot be decoded without the tokenizer they were made with")
    try:  # the sha covers the special-token settings too, so it is the loaded tokenizer's
        actual = _tokenizer_sha256(path)
        found = f"has sha256 {actual[:12]}..."
    except TokenizerError as e:
        actual, found = None, f"does not load ({e})"
    if actual != recorded:
        raise DataError(
            f"tokenizer mismatch in {str(data_dir)!r}: the token files were made with tokenizer sha256 {recorded[:12]}..., "
            f"but {path.name} {found}; refusing to mix them (prepare the data again)"
        )
    if tokenizer_sha256 is not None and tokenizer_sha256 != recorded:
        raise DataError(
            f"tokenizer mismatch: {str(data_dir)!r} was tokenized with sha256 {recorded[:12]}..., "
            f"but {tokenizer_sha256[:12]}... was expected (the run was started with other data)"
        )
    dtype = np.dtype(meta["dtype"])
    for source in meta["sources"].values():
        for split in SPLITS:
            if split in source:
                _check_size(data_dir / source[split]["file"], source[split]["tokens"], dtype)
    return meta


_TOKENIZER_SHAS: dict[tuple, str] = {}


def _tokenizer_sha256(path: Path) -> str:
    """``load_tokenizer(path).sha256``, once per process while its files are unchanged: a large
    tokenizer.json takes about a second to load, and load_meta runs once per source evaluated."""
    files = [f for f in (path, *(path.parent / name for name in SIDE_FILES)) if f.is_file()]
    key = tuple((str(f.resolve()), st.st_size, st.st_mtime_ns) for f in files for st in (f.stat(),))
    if key not in _TOKENIZER_SHAS:
        _TOKENIZER_SHAS[key] = load_tokenizer(path).sha256
    return _TOKENIZER_SHAS[key]


def _check_size(path: Path, tokens: int, dtype: np.dtype) -> None:
    if not path.is_file():
        raise DataError(f"token file {path} is missing")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"token file {path} is corrupt: {size} bytes is not a whole number of {dtype.name} tokens")
    if size // dtype.itemsize != tokens:
        raise DataError(f"token file {path} is corrupt or truncated: it holds {size // dtype.itemsize} tokens, meta.json says {tokens}")


def open_tokens(data_dir: str | os.PathLike, meta: dict, name: str, split: str) -> np.memmap:
    """A read-only memmap of one token file (``meta`` from [load_meta][fibjax.data.load_meta])."""
    sources = meta["sources"]
    if name not in sources:
        raise DataError(f"unknown source {name!r} in {str(data_dir)!r}; it has {sorted(sources)}")
    if split not in sources[name]:
        have = [s for s in SPLITS if s in sources[name]]
        raise DataError(f"source {name!r} in {str(data_dir)!r} has no {split} split (it has {have})")
    path = Path(data_dir) / sources[name][split]["file"]
    check_token_ids(path, np.dtype(meta["dtype"]), meta["tokenizer"]["vocab_size"])
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


_CHECKED_IDS: set[tuple[str, int, int]] = set()


def check_token_ids(path: Path, dtype: np.dtype, vocab_size: int) -> None:
    """Every token id in ``path`` is below ``vocab_size``.

    Bytes changed on disk keep a file's size, so the size check passes, but an id past the
    vocabulary makes the embedding lookup NaN. A vectorised max over the memmap (about 7 G
    tokens/s from the page cache), done once per file and process."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _CHECKED_IDS or stat.st_size == 0:
        return
    top = int(np.memmap(path, dtype=dtype, mode="r").max())
    if top >= vocab_size:
        raise DataError(
            f"token file {path} is corrupt: it holds token id {top}, but the tokenizer has {vocab_size} pieces (bytes changed on disk?); prepare the data again"
        )
    _CHECKED_IDS.add(key)


_VERIFIED: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256, in this process


def file_stamp(path: Path) -> dict:
    """What says a file is still the one hashed: its size and modification time."""
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


# what to do about a damaged token file (launch.prepare_data, which prepares it, says it its own way)
PREPARE_AGAIN = "prepare it again: the command that prepared it, with --overwrite"


def verify_checksums(data_dir: str | os.PathLike, meta: dict, verified: dict | None = None, *, remedy: str | None = PREPARE_AGAIN) -> dict:
    """Every token file's sha256 against the one meta.json records for it. ``verified``: a
    run's record of files already verified ({file: {sha256, size, mtime_ns}}, see
    ``file_stamp``); a file still matching its entry is not hashed again (measured on 2 busy
    cores: 126 MiB/s, 0.23 s for the CPU study's 15 M tokens, ~8 s per GB). Returns the record of every file, with ``sha256`` None for
    data prepared before meta.json carried checksums. Raises DataError naming the first file
    whose bytes changed."""
    data_dir, verified = Path(data_dir), verified or {}
    record = {}
    for source in meta["sources"].values():
        for split in SPLITS:
            if split not in source:
                continue
            name, expected = source[split]["file"], source[split].get("sha256")
            path = data_dir / name
            stamp = file_stamp(path)
            record[name] = {"sha256": expected, **stamp}
            key = (str(path.resolve()), stamp["size"], stamp["mtime_ns"])
            if expected is None or verified.get(name) == record[name] or _VERIFIED.get(key) == expected:
                continue
            if file_sha256(path) != expected:
                raise DataError(
                    f"token file {path} is damaged: its sha256 differs from the one meta.json recorded when it was prepared "
                    f"(bytes changed on disk){f'; {remedy}' if remedy else ''}"
                )
            _VERIFIED[key] = expected
    return record


def validation_tokens(data_dir: str | os.PathLike, name: str) -> np.memmap:
    """The validation tokens of source ``name`` (documents separated by EOS), as a memmap.

    Args:
        data_dir: The prepared data.
        name: The source's name.

    Returns:
        The tokens.
    """
    return open_tokens(data_dir, load_meta(data_dir), name, "val")


def validation_sources(meta: dict) -> list[str]:
    """Names of the sources that have a validation split, in sorted order.

    Args:
        meta: The data's ``meta.json`` contents.

    Returns:
        The names.
    """
    return sorted(n for n, s in meta["sources"].items() if "val" in s)
