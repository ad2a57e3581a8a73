"""Corpus preparation: documents -> tokenizer (trained, or given) -> flat token files + meta.json.

Idempotent: the inputs (file paths, sizes and mtimes; dataset specs; options; a given
tokenizer's hash) are fingerprinted, and a directory whose meta.json carries the same
fingerprint is left as it is. A directory prepared from other inputs is refused unless
``overwrite``. meta.json is removed first and written last, so a run that dies half-way never
leaves a directory that looks complete; a full disk ends it with one DataError naming the
directory and its free space.

Validation: a source's ``val`` inputs when given; otherwise a deterministic ``val_fraction`` of
its documents, chosen by content hash (``fibjax.data.sources.is_held_out``).
Budgets: ``max_docs`` bounds the documents read from each input stream, ``max_tokens`` stops a
split once it holds at least that many tokens (the last document is kept whole).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece
import tokenizers
from tqdm.auto import tqdm

from fibjax.data.sentencepiece_tokenizer import train_tokenizer
from fibjax.data.sources import EMBEDDED_SPEC, DataError, check_hub_reachable, check_name, describe_inputs, is_held_out, is_hf, read_documents
from fibjax.data.token_files import (
    FORMAT_VERSION,
    META_FILE,
    file_sha256,
    free_space,
    load_meta,
    read_meta_file,
    split_file,
    token_dtype,
    verify_checksums,
    write_json_atomically,
)
from fibjax.data.tokenizer import HF_FILE, SENTENCEPIECE_FILE, TOKENIZER_CONFIG, Tokenizer, load_tokenizer

DEFAULT_VOCAB_SIZE = 32768
DEFAULT_VAL_FRACTION = 0.01
# Characters of training text the tokenizer learns from (spread over the sources in turn).
DEFAULT_TOKENIZER_CHARS = 20_000_000
EMBEDDED_NAME = "python_docs"
# The embedded corpus is small (~110 documents): hold out a tenth so validation is ~10 k tokens.
EMBEDDED_VAL_FRACTION = 0.1
_ENCODE_BATCH_DOCS = 256


def _full_disk_is_a_data_error(prepare_fn):
    """OSError(ENOSPC) from anywhere in ``prepare`` (a token file, the tokenizer, meta.json) as one
    DataError naming the directory and its free space, instead of a traceback."""

    @functools.wraps(prepare_fn)
    def wrapper(out_dir, *args, **kwargs):
        try:
            return prepare_fn(out_dir, *args, **kwargs)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise DataError(
                f"no space left on the device while writing {e.filename or out_dir} ({free_space(out_dir)} free there); "
                f"{out_dir} is left unfinished (it has no {META_FILE}): free some space and run the same command again"
            ) from None

    return wrapper


def _no_empty_directory_left(prepare_fn):
    """A failure before anything was written leaves no empty ``out_dir`` behind (a later run
    would otherwise find a directory that looks prepared but is not)."""

    @functools.wraps(prepare_fn)
    def wrapper(out_dir, *args, **kwargs):
        created = not Path(out_dir).exists()
        try:
            return prepare_fn(out_dir, *args, **kwargs)
        except BaseException:
            if created and Path(out_dir).is_dir() and not any(Path(out_dir).iterdir()):
                Path(out_dir).rmdir()
            raise

    return wrapper


@_no_empty_directory_left
@_full_disk_is_a_data_error
def prepare(  # noqa: DOC503
    out_dir: str | os.PathLike,
    sources: dict[str, str],
    val: dict[str, str] | None = None,
    *,
    vocab_size: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    max_tokens: int | None = None,
    max_docs: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    tokenizer_chars: int = DEFAULT_TOKENIZER_CHARS,
    overwrite: bool = False,
    progress: bool = True,
    redo: str | None = None,
) -> dict:
    """Prepare ``out_dir`` from ``sources`` ({name: spec}, see ``fibjax.data.sources``).

    ``val`` maps names to validation specs; a name that is not a training source becomes a
    validation-only source (e.g. an extra in-domain evaluation set). ``tokenizer`` (anything
    [load_tokenizer][fibjax.data.load_tokenizer] takes: a ``.model``, a ``tokenizer.json``, a Hugging Face model
    directory) is used instead of training one of ``vocab_size`` pieces. ``redo`` says how to prepare
    damaged data again where ``--overwrite`` is not the caller's flag.

    Args:
        out_dir: The data directory.
        sources: {name: spec} of the training sources.
        val: {name: spec} of validation data.
        vocab_size: The trained tokenizer's pieces (default 32768; must match a given tokenizer).
        tokenizer: A tokenizer to use instead of training one.
        max_tokens: Stop a split once it holds at least this many tokens.
        max_docs: The most documents read from each input stream.
        val_fraction: The share of each training source held out for validation when ``val`` gives
            it none.
        tokenizer_chars: The characters of training text a tokenizer learns from.
        overwrite: Replace data prepared from other inputs or options, or damaged data.
        progress: Show progress bars.
        redo: The command to prepare damaged data again, for messages.

    Returns:
        The data's ``meta.json`` contents.

    Raises:
        DataError: Bad arguments, data in ``out_dir`` from other inputs (without ``overwrite``), or
            an input that cannot be read.
    """
    out_dir, val = Path(out_dir), dict(val or {})
    _check_arguments(sources, val, vocab_size, tokenizer, max_tokens, max_docs, val_fraction)
    given = load_tokenizer(tokenizer) if tokenizer else None
    if given and vocab_size is not None and vocab_size != given.vocab_size:
        raise DataError(f"vocab_size {vocab_size} contradicts the given tokenizer {str(tokenizer)!r}, whose vocabulary is {given.vocab_size}")
    vocab_size = given.vocab_size if given else (vocab_size or DEFAULT_VOCAB_SIZE)
    options = {
        "vocab_size": vocab_size,
        "max_tokens": max_tokens,
        "max_docs": max_docs,
        "val_fraction": val_fraction,
        "tokenizer_chars": None if given else tokenizer_chars,
    }
    inputs = {name: {"train": describe_inputs(spec)} for name, spec in sources.items()}
    for name, spec in val.items():
        inputs.setdefault(name, {})["val"] = describe_inputs(spec)
    fingerprint = _sha256_json({"format": FORMAT_VERSION, "inputs": inputs, "options": options, "tokenizer": given.sha256 if given else "trained"})

    existing = read_meta_file(out_dir) if out_dir.is_dir() else None
    if existing is not None:
        if existing.get("fingerprint") == fingerprint:
            try:
                return _with_checksums(out_dir, load_meta(out_dir))
            except DataError as e:
                if not overwrite:
                    raise DataError(f"{e}; {redo or 'pass --overwrite'} to prepare it again") from None
        elif not overwrite:
            fix = f"{redo} to prepare it again" if redo else "choose another output directory or pass --overwrite"
            raise DataError(f"{str(out_dir)!r} already holds data prepared from other inputs or options; {fix}")
        (out_dir / META_FILE).unlink()
    check_hub_reachable([*sources.values(), *val.values()])  # before any directory is made
    out_dir.mkdir(parents=True, exist_ok=True)

    def train_documents(name: str) -> Iterator[str]:
        docs = _bounded(read_documents(sources[name]), max_docs)
        return docs if name in val else (d for d in docs if not is_held_out(d, val_fraction))

    if given:
        tok = given
    else:
        if progress:
            print(f"training a {vocab_size}-piece BPE tokenizer on up to {tokenizer_chars:,} characters", file=sys.stderr)
        tok = train_tokenizer(_round_robin([train_documents(n) for n in sources], tokenizer_chars), vocab_size)
    for stale in (SENTENCEPIECE_FILE, HF_FILE, TOKENIZER_CONFIG):  # another tokenizer's, from an overwritten preparation
        (out_dir / stale).unlink(missing_ok=True)
    tok.save(out_dir)

    writer_args = dict(out_dir=out_dir, dtype=token_dtype(tok.vocab_size), tok=tok, max_tokens=max_tokens, progress=progress)
    entries: dict[str, dict] = {}
    for name, spec in sources.items():
        holdout = None if name in val else val_fraction
        entries[name] = _write_stream(name, spec, _bounded(read_documents(spec), max_docs), holdout=holdout, **writer_args)
    for name, spec in val.items():
        written = _write_stream(name, spec, _bounded(read_documents(spec), max_docs), split="val", **writer_args)
        entries.setdefault(name, {})["val"] = written["val"] | {"from": "files"}
    for entry in entries.values():
        for split in entry.values():
            split["inputs"] = [i[0] if isinstance(i, list) else i for i in describe_inputs(split["spec"])]

    meta = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "dtype": token_dtype(tok.vocab_size).name,
        "tokenizer": tokenizer_entry(tok, str(Path(tokenizer).resolve()) if tokenizer else "trained"),
        "sources": entries,
        "options": options,
        "versions": {"python": sys.version.split()[0], "sentencepiece": sentencepiece.__version__, "tokenizers": tokenizers.__version__},
    }
    write_json_atomically(out_dir / META_FILE, meta)
    return meta


def _with_checksums(out_dir: Path, meta: dict) -> dict:
    """Prepared data whose files still match their checksums; data prepared before meta.json
    carried checksums gets them, from the files as they are now (their sizes were just checked):
    from then on a change is detected."""
    verify_checksums(out_dir, meta, remedy=None)  # prepare() says what to do
    missing = [split for source in meta["sources"].values() for split in source.values() if "sha256" not in split]
    if missing:
        for split in missing:
            split["sha256"] = file_sha256(out_dir / split["file"])
        try:
            write_json_atomically(out_dir / META_FILE, meta)
        except OSError:  # a read-only directory (a run evaluated where it cannot write): used as it is
            return load_meta(out_dir)
        print(f"recorded the sha256 of {len(missing)} token file(s) in {out_dir / META_FILE}", file=sys.stderr)
    return meta


def prepare_default(out_dir: str | os.PathLike, vocab_size: int = 2048, *, progress: bool = False) -> dict:
    """Prepare the embedded corpus (Python's reference manual topics) into ``out_dir``; a
    no-op when it is already there. Offline: the text ships with Python.

    Args:
        out_dir: The data directory.
        vocab_size: The tokenizer's vocabulary size.
        progress: Show progress bars.

    Returns:
        The data's ``meta.json`` contents.
    """
    return prepare(
        out_dir,
        {EMBEDDED_NAME: EMBEDDED_SPEC},
        vocab_size=vocab_size,
        val_fraction=EMBEDDED_VAL_FRACTION,
        progress=progress,
        redo=f"delete {out_dir} (a copy of the embedded corpus) and run the same command again",
    )


def _check_arguments(sources, val, vocab_size, tokenizer, max_tokens, max_docs, val_fraction) -> None:
    if not sources and not val:
        raise DataError("no source given (e.g. --source fineweb=/path/to/files, or --val NAME=FILES for validation only)")
    if not sources and not tokenizer:
        # a tokenizer trained on held-out text alone would match no run: evaluation needs the run's
        raise DataError(
            "validation-only data (--val without --source) needs the tokenizer of the runs it evaluates: pass --tokenizer RUN_DATA (their data directory)"
        )
    for name in (*sources, *val):
        check_name(name)
    for label, value in (("max_tokens", max_tokens), ("max_docs", max_docs), ("vocab_size", vocab_size)):
        if value is not None and value < 1:
            raise DataError(f"{label} must be >= 1, got {value}")
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    unbounded = [s for s in (*sources.values(), *val.values()) if is_hf(s)] if max_tokens is None and max_docs is None else []
    if unbounded:
        raise DataError(f"streaming {unbounded[0]!r} needs a budget: pass --max-tokens or --max-docs")


def _sha256_json(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _bounded(docs: Iterator[str], max_docs: int | None) -> Iterator[str]:
    return docs if max_docs is None else itertools.islice(docs, max_docs)


def _round_robin(streams: list[Iterator[str]], max_chars: int) -> Iterator[str]:
    """Documents from every stream in turn until ``max_chars``: each source shapes the vocabulary."""
    chars, active = 0, list(streams)
    while active:
        for stream in list(active):
            doc = next(stream, None)
            if doc is None:
                active.remove(stream)
                continue
            yield doc
            chars += len(doc)
            if chars >= max_chars:
                return


class _TokenFile:
    """Appends documents (``start`` ids, the document's, EOS) to ``<name>/<split>.bin.tmp``;
    renamed on finish."""

    def __init__(self, out_dir: Path, name: str, split: str, dtype: np.dtype, start: list[int], eos_id: int):
        self.relative = split_file(name, split)
        self.path = out_dir / self.relative
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.dtype, self.start, self.eos = dtype, np.array(start, dtype), np.array([eos_id], dtype)
        self.tokens = self.documents = 0
        self.digest = hashlib.sha256()  # of the bytes as written: no second read of the file

    def add(self, docs: Iterable[list[int]]) -> None:
        pieces = [p for ids in docs for p in (self.start, np.asarray(ids, self.dtype), self.eos)]
        if pieces:
            block = np.concatenate(pieces)
            self.file.write(block)  # not block.tofile: its OSError carries no errno, so a full disk would not be recognised
            self.digest.update(block)
            self.tokens += block.size
            self.documents += len(pieces) // 3

    def finish(self, spec: str) -> dict:
        self.file.close()
        os.replace(self.tmp, self.path)
        return {"spec": spec, "file": self.relative, "tokens": self.tokens, "documents": self.documents, "sha256": self.digest.hexdigest()}

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _write_stream(
    name: str,
    spec: str,
    docs: Iterator[str],
    *,
    out_dir: Path,
    dtype: np.dtype,
    tok: Tokenizer,
    max_tokens: int | None,
    progress: bool,
    holdout: float | None = None,
    split: str = "train",
) -> dict:
    """Encode ``docs`` into ``split`` (and, with ``holdout``, a content-hash fraction into val)."""
    files = {split: _TokenFile(out_dir, name, split, dtype, tok.document_start, tok.eos_id)}
    if holdout is not None:
        files["val"] = _TokenFile(out_dir, name, "val", dtype, tok.document_start, tok.eos_id)
    bar = tqdm(desc=f"{name}/{split}", unit="doc", disable=not progress)
    try:
        while max_tokens is None or files[split].tokens < max_tokens:
            batch = list(itertools.islice(docs, _ENCODE_BATCH_DOCS))
            if not batch:
                break
            held = [holdout is not None and is_held_out(d, holdout) for d in batch]
            encoded = tok.encode_batch(batch)
            if max_tokens is not None:  # keep documents up to and including the one that reaches the budget
                room, kept = max_tokens - files[split].tokens, 0
                for i, (ids, h) in enumerate(zip(encoded, held)):
                    if kept >= room:
                        encoded, held = encoded[:i], held[:i]
                        break
                    kept += 0 if h else len(tok.document_start) + len(ids) + 1  # + EOS
            files[split].add(ids for ids, h in zip(encoded, held) if not h)
            if holdout is not None:
                files["val"].add(ids for ids, h in zip(encoded, held) if h)
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{files[split].tokens:,}")
    except BaseException:
        for f in files.values():
            f.abandon()
        raise
    finally:
        bar.close()
    for split, f in files.items():
        if f.documents == 0:
            for g in files.values():
                g.abandon()
            why = (
                f" (none of the documents fell in the held-out fraction {holdout}; pass --val or a larger --val-fraction)" if split == "val" and holdout else ""
            )
            raise DataError(f"source {name!r} ({spec}) produced no {split} document{why}")
    try:
        entry = {split: f.finish(spec) for split, f in files.items()}
    except OSError:  # a full disk can surface only when the last buffer is flushed
        for f in files.values():
            f.abandon()
        raise
    if holdout is not None:
        entry["val"]["from"] = f"holdout {holdout}"
    return entry


def tokenizer_entry(tok: Tokenizer, source: str) -> dict:
    """meta.json's record of the tokenizer every token file of a directory was made with."""
    ids = {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id, "add_bos": tok.add_bos}
    return {"file": tok.file_name, "sha256": tok.sha256, **ids, "from": source}


def prepare_tokenizer_only(out_dir: str | os.PathLike, tok: Tokenizer, source: str) -> dict:
    """A data directory that holds a tokenizer and no token files (an imported model's: its
    commands read the tokenizer here; evaluation and training text is prepared elsewhere with
    ``--tokenizer``, and checked against this one by its sha256)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(out_dir)
    entry = tokenizer_entry(tok, source)
    fingerprint = _sha256_json({"format": FORMAT_VERSION, "inputs": {}, "tokenizer": tok.sha256})
    meta = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "dtype": token_dtype(tok.vocab_size).name, "tokenizer": entry, "sources": {}, "options": {}}
    write_json_atomically(out_dir / META_FILE, meta)
    return meta
