"""Where documents come from: local files and folders, Hugging Face datasets, the embedded corpus.

A source *spec* is one of
  - local paths, comma-separated; each a file, a folder (searched recursively) or a glob:
      ``.txt``                one document per file; a file holding ``<|endoftext|>`` markers
                              (the GPT-2 / TinyStories raw convention) is split on them. Blank
                              lines are *not* boundaries: they separate paragraphs in prose.
      ``.jsonl``/``.jsonl.gz`` one JSON object per line, the document in its ``text`` field
      ``.parquet``            the ``text`` column
  - ``hf:DATASET[:CONFIG][@SPLIT]``  streamed with the ``datasets`` package (network needed),
  - ``embedded:python-docs``  the Python reference manual topics that ship with every Python
                              (``pydoc_data/topics.py``): English prose, no download.
Empty documents are skipped; an input with no document at all is an error naming it.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import socket
import sys
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path

from fibjax.errors import FibjaxError, pip_install


class DataError(FibjaxError, ValueError):
    """Bad data inputs or prepared data; the message names the file or source."""


SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
EMBEDDED_SPEC = "embedded:python-docs"
_HF_PREFIX = "hf:"
_TXT_SEPARATOR = "<|endoftext|>"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def parse_named(arg: str) -> tuple[str, str]:
    """ "NAME=SPEC" -> (name, spec); the name becomes a folder, so it is kept simple."""
    name, sep, spec = arg.partition("=")
    name, spec = name.strip(), spec.strip()
    if not sep or not spec:
        raise DataError(f"expected NAME=PATH_OR_SPEC, got {arg!r}")
    check_name(name)
    return name, spec


def check_name(name: str) -> None:
    """A source name becomes a folder next to meta.json, so it is kept plain."""
    if not _NAME.fullmatch(name):
        raise DataError(f"source name {name!r} must start with a letter or digit and hold only letters, digits, '_' and '-'")


def is_hf(spec: str) -> bool:
    return spec.startswith(_HF_PREFIX)


def _suffix(path: Path) -> str | None:
    return next((s for s in SUFFIXES if path.name.endswith(s)), None)


def resolve_files(spec: str) -> list[Path]:
    """The input files of a local spec, in a fixed order (given order; sorted within folders/globs)."""
    files: list[Path] = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        if glob.has_magic(entry):
            matches = sorted(Path(p) for p in glob.glob(entry, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(f"no file matches {entry!r}")
        elif Path(entry).is_dir():
            matches = sorted(p for p in Path(entry).rglob("*") if p.is_file() and _suffix(p))
            if not matches:
                raise DataError(f"folder {entry!r} holds no {'/'.join(SUFFIXES)} file")
        elif Path(entry).exists():
            matches = [Path(entry)]
        else:
            raise DataError(f"input {entry!r} does not exist")
        for path in matches:
            if not _suffix(path):
                raise DataError(f"input {str(path)!r}: unsupported file type (expected one of {', '.join(SUFFIXES)})")
        files += matches
    if not files:
        raise DataError(f"no input file in {spec!r}")
    return files


def describe_inputs(spec: str) -> list:
    """What identifies the inputs for the fingerprint: path, size and mtime of each file
    (cheap, no content hash), the dataset spec, or the embedded text's hash."""
    if is_hf(spec):
        return [spec]
    if spec == EMBEDDED_SPEC:
        return [spec, hashlib.sha256("\0".join(embedded_documents()).encode()).hexdigest()]
    out = []
    for path in resolve_files(spec):
        stat = path.stat()
        out.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return out


def read_documents(spec: str) -> Iterator[str]:
    """Every non-empty document of a source, in a fixed order."""
    if is_hf(spec):
        yield from _hf_documents(spec)
    elif spec == EMBEDDED_SPEC:
        yield from embedded_documents()
    else:
        for path in resolve_files(spec):
            yield from _file_documents(path)


def _file_documents(path: Path) -> Iterator[str]:
    count = 0
    try:
        for text in _READERS[_suffix(path)](path):
            if text.strip():
                count += 1
                yield text
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read {str(path)!r}: {e}") from None
    if count == 0:
        raise DataError(f"input {str(path)!r} holds no document (empty file or only blank text)")


def _txt(path: Path) -> Iterator[str]:
    text = path.read_text(encoding="utf-8")
    yield from (text.split(_TXT_SEPARATOR) if _TXT_SEPARATOR in text else [text])


def _jsonl(path: Path) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: not valid JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{path}:{line_no}: expected an object with a string field 'text'")
            yield record["text"]


def _parquet(path: Path) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        if "text" not in table.schema_arrow.names:
            raise DataError(f"{str(path)!r} has no 'text' column (columns: {table.schema_arrow.names})")
        for batch in table.iter_batches(columns=["text"], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if t is not None)
    except pa.ArrowException as e:
        raise DataError(f"cannot read {str(path)!r} as parquet: {e}") from None


_READERS = {".txt": _txt, ".jsonl": _jsonl, ".jsonl.gz": _jsonl, ".parquet": _parquet}


def check_hub_reachable(specs, timeout_s: float = 10.0) -> None:
    """One error at once when ``hf:`` sources cannot be read: no ``datasets`` package, or no
    connection to the Hub. Without this check ``datasets`` retries each request many times
    (dozens of warnings over minutes) before failing. Offline mode (``HF_DATASETS_OFFLINE`` or
    ``HF_HUB_OFFLINE`` set to 1) reads the local cache, so the connection is not checked."""
    hf = [spec for spec in specs if is_hf(spec)]
    if not hf:
        return
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DataError(f"source {hf[0]!r} needs the Hugging Face 'datasets' package: {pip_install('hf')}") from None
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")):
        return
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout_s).close()
    except OSError as e:
        raise DataError(
            f"cannot reach the Hugging Face Hub ({url.hostname}: {e.strerror or e}) to stream {hf[0]!r}: run where it is reachable, "
            "or set HF_DATASETS_OFFLINE=1 to read datasets already in the local Hugging Face cache"
        ) from None


def _hf_documents(spec: str) -> Iterator[str]:
    """Stream ``hf:DATASET[:CONFIG][@SPLIT]`` (split defaults to train). Untested here: this
    machine has no network; the caller bounds it with a document or token budget."""
    body, _, split = spec[len(_HF_PREFIX) :].partition("@")
    dataset, _, config = body.partition(":")
    try:
        import datasets
    except ImportError:
        raise DataError(f"source {spec!r} needs the Hugging Face 'datasets' package (pip install datasets) and network access") from None
    try:
        rows = datasets.load_dataset(dataset, config or None, split=split or "train", streaming=True)
        for row in rows:
            text = row.get("text")
            if isinstance(text, str) and text.strip():
                yield text
    except Exception as e:  # network, auth and name errors come in many types
        raise DataError(f"cannot stream Hugging Face dataset {spec!r}: {type(e).__name__}: {e}") from None


def is_held_out(text: str, fraction: float) -> bool:
    """Deterministic validation hold-out by content hash: independent of file order and of
    which other documents are present."""
    digest = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return digest < fraction * 2**64


_UNDERLINE = re.compile(r"[=*\-]+")


def _body(section: str) -> str:
    """A section without its heading and underline (topics repeat sections under other headings)."""
    lines = section.split("\n", 2)
    if len(lines) == 3 and _UNDERLINE.fullmatch(lines[1]):
        return lines[2].strip()
    return section


def embedded_documents() -> list[str]:
    """The Python reference manual topics (``pydoc_data/topics.py``, this Python's own copy)
    split into sections at their ``====`` headings: ~110 documents, ~370 k characters on
    3.11. A section whose text also appears inside another one is dropped: the topics repeat
    whole sections ("Basic customization" is in both "customization" and "specialnames"),
    and a repeat could land on both sides of the train/validation split."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError("the embedded corpus needs the standard library's pydoc_data module, which this Python lacks") from None
    sections = []
    for key in sorted(topics):
        parts = re.split(r"\n(?=[^\n]+\n=+\n)", topics[key].strip())
        sections += [p.strip() for p in parts if p.strip()]
    bodies = [_body(s) for s in sections]
    unique = []
    for i, body in enumerate(bodies):
        repeated = any(body in other and (len(other) > len(body) or j < i) for j, other in enumerate(bodies) if j != i)
        if not repeated:
            unique.append(sections[i])
    if not unique:
        raise DataError(f"the embedded corpus is empty: pydoc_data/topics.py of Python {sys.version.split()[0]} holds no text")
    return unique
