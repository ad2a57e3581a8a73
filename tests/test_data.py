"""Data: tokenizer, sources, preparation (idempotence, refusals), and the Grain pipeline.

The corpora are real English text every clone has: Python's reference manual (the embedded
corpus, see conftest.manual_documents), written into tmp_path as the files a user brings (JSON
Lines, gzipped JSON Lines, parquet), a few hundred documents each, so the whole file runs in
seconds and nothing here needs ../shared.
"""

import gzip
import json
import os
import shutil
from pathlib import Path

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fibjax.data import DataError, Tokenizer, TokenizerError, load_meta, prepare, prepare_default, train_iterator, train_tokenizer, validation_tokens
from fibjax.data.sources import EMBEDDED_SPEC, embedded_documents, is_held_out, read_documents
from launch import prepare_data


def write_jsonl(docs: list[str], path: Path) -> Path:
    """One ``{"text": ...}`` object per line; gzipped when the name ends in .gz."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    return path


def documents_in(tokens: np.ndarray, tok: Tokenizer) -> list[str]:
    """Split a token file on EOS and decode every document."""
    ends = np.flatnonzero(np.asarray(tokens) == tok.eos_id)
    assert ends.size and ends[-1] == len(tokens) - 1, "every document ends with EOS"
    return [tok.decode(doc) for doc in np.split(np.asarray(tokens), ends + 1)[:-1]]


def window_offsets(tokens: np.ndarray, row: np.ndarray) -> list[int]:
    """Every offset at which ``row`` is a contiguous slice of ``tokens`` (a byte search)."""
    tokens = np.asarray(tokens)
    haystack, needle = tokens.tobytes(), np.asarray(row, tokens.dtype).tobytes()
    found, at = [], haystack.find(needle)
    while at >= 0:
        if at % tokens.itemsize == 0:
            found.append(at // tokens.itemsize)
        at = haystack.find(needle, at + 1)
    return found


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, manual_documents):
    """Four disjoint slices of the manual: "web" (300 documents, validation held out by hash,
    plain JSON Lines), "wiki" (40, gzipped, with a validation file of 10) and "stories" (50,
    parquet, validation only). ``docs`` holds each slice's documents in file order."""
    root = tmp_path_factory.mktemp("corpus")
    docs = {"web": manual_documents[:300], "wiki": manual_documents[300:340], "wiki_val": manual_documents[340:350], "stories_val": manual_documents[350:400]}
    pq.write_table(pa.table({"text": docs["stories_val"]}), root / "stories_val.parquet")
    return {
        "web": write_jsonl(docs["web"], root / "web.jsonl"),
        "wiki": write_jsonl(docs["wiki"], root / "wiki.jsonl.gz"),
        "wiki_val": write_jsonl(docs["wiki_val"], root / "wiki_val.jsonl.gz"),
        "stories_val": root / "stories_val.parquet",
        "docs": docs,
    }


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(
        out,
        {"web": str(corpus["web"]), "wiki": str(corpus["wiki"])},
        {"wiki": str(corpus["wiki_val"]), "stories": str(corpus["stories_val"])},
        vocab_size=1024,
        val_fraction=0.1,
        progress=False,
    )
    return out


# ---- tokenizer ------------------------------------------------------------------------


def test_tokenizer_round_trips_any_text_and_trains_deterministically():
    docs = embedded_documents()
    first, second = train_tokenizer(docs, 600), train_tokenizer(docs, 600)
    assert first.model_bytes == second.model_bytes and first.sha256 == second.sha256
    assert first.vocab_size == 600 and first.eos_id == 1
    for text in ["Hello\n\n  world\tand  spaces  ", "ünïcödé 中文 🙂 \u200b", docs[3]]:
        assert first.decode(first.encode(text)) == text
    assert first.encode_batch(["a b", "c"]) == [first.encode("a b"), first.encode("c")]
    assert train_tokenizer(docs[::-1], 600).sha256 == first.sha256  # BPE counts pairs: order does not matter
    assert train_tokenizer(docs[:60], 600).sha256 != first.sha256


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="too small.*needs at least"):
        train_tokenizer(embedded_documents(), 259)
    with pytest.raises(TokenizerError, match="empty text"):
        train_tokenizer(["", "  \n "], 512)
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope.model")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a valid SentencePiece model"):
        Tokenizer.load(tmp_path / "bad.model")


# ---- preparation ----------------------------------------------------------------------


def test_prepare_writes_every_document_once_with_eos(prepared, corpus):
    meta = load_meta(prepared)
    tok = Tokenizer.load(prepared / "tokenizer.model")
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["sha256"] == tok.sha256 and meta["tokenizer"]["vocab_size"] == 1024
    web = corpus["docs"]["web"]
    train = documents_in(np.fromfile(prepared / "web" / "train.bin", np.uint16), tok)
    val = documents_in(validation_tokens(prepared, "web"), tok)
    assert train == [d for d in web if not is_held_out(d, 0.1)]
    assert val == [d for d in web if is_held_out(d, 0.1)] and 10 <= len(val) <= 60
    assert documents_in(np.fromfile(prepared / "wiki" / "train.bin", np.uint16), tok) == corpus["docs"]["wiki"]
    assert documents_in(validation_tokens(prepared, "wiki"), tok) == corpus["docs"]["wiki_val"]
    assert documents_in(validation_tokens(prepared, "stories"), tok) == corpus["docs"]["stories_val"]
    assert meta["sources"]["wiki"]["val"]["from"] == "files"
    assert set(meta["sources"]["stories"]) == {"val"}  # a validation-only source
    for name, source in meta["sources"].items():
        for split, entry in source.items():
            assert entry["tokens"] == os.path.getsize(prepared / entry["file"]) // 2, (name, split)
    assert meta["sources"]["web"]["train"]["documents"] == len(train)


def test_rerun_is_a_no_op_and_other_inputs_are_refused(prepared, corpus):
    files = sorted(prepared.rglob("*"))
    stamps = [f.stat().st_mtime_ns for f in files]
    meta = prepare_data.main(
        [
            "--out",
            str(prepared),
            "--source",
            f"web={corpus['web']}",
            "--source",
            f"wiki={corpus['wiki']}",
            "--val",
            f"wiki={corpus['wiki_val']}",
            "--val",
            f"stories={corpus['stories_val']}",
            "--vocab-size",
            "1024",
            "--val-fraction",
            "0.1",
            "--quiet",
        ]
    )
    assert meta == 0
    assert sorted(prepared.rglob("*")) == files and [f.stat().st_mtime_ns for f in files] == stamps
    with pytest.raises(DataError, match="other inputs.*--overwrite"):
        prepare(prepared, {"web": str(corpus["web"])}, vocab_size=1024, progress=False)


def test_given_tokenizer_is_reused_and_mismatches_are_refused(prepared, corpus, tmp_path):
    out = tmp_path / "reuse"
    meta = prepare(out, {"wiki": str(corpus["wiki"])}, tokenizer=prepared / "tokenizer.model", max_docs=20, progress=False)
    assert meta["tokenizer"]["sha256"] == load_meta(prepared)["tokenizer"]["sha256"]
    with pytest.raises(DataError, match="contradicts"):
        prepare(tmp_path / "x", {"wiki": str(corpus["wiki"])}, tokenizer=prepared / "tokenizer.model", vocab_size=512, progress=False)
    train_tokenizer(embedded_documents(), 512).save(out)
    with pytest.raises(DataError, match="tokenizer mismatch.*refusing"):
        load_meta(out)
    with pytest.raises(DataError, match="tokenizer mismatch"):
        train_iterator(out, {}, seq_len=8, global_batch=2, seed=0)
    with pytest.raises(DataError, match="tokenizer mismatch.*expected"):
        load_meta(prepared, tokenizer_sha256="0" * 64)


def test_validation_only_data_uses_a_given_tokenizer(prepared, corpus, tmp_path):
    """``--val`` without ``--source``: held-out text tokenized with a run's tokenizer (evaluating
    a run on new text); without the tokenizer it is refused, as is no input at all."""
    meta = prepare(tmp_path / "val_only", {}, {"stories": str(corpus["stories_val"])}, tokenizer=prepared / "tokenizer.model", progress=False)
    assert list(meta["sources"]) == ["stories"] and list(meta["sources"]["stories"]) == ["val"]
    tok = Tokenizer.load(prepared / "tokenizer.model")
    assert documents_in(np.asarray(validation_tokens(tmp_path / "val_only", "stories")), tok) == corpus["docs"]["stories_val"]
    with pytest.raises(DataError, match="needs the tokenizer.*--tokenizer"):
        prepare(tmp_path / "x", {}, {"stories": str(corpus["stories_val"])}, progress=False)
    with pytest.raises(DataError, match="no source given"):
        prepare(tmp_path / "y", {}, {}, tokenizer=prepared / "tokenizer.model", progress=False)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_corrupt_or_truncated_token_files_are_errors(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    train = copy / "wiki" / "train.bin"
    data = train.read_bytes()
    train.write_bytes(data[:-1])
    with pytest.raises(DataError, match="corrupt: .* not a whole number of uint16"):
        load_meta(copy)
    train.write_bytes(data[:-2])
    with pytest.raises(DataError, match="truncated: it holds .* meta.json says"):
        train_iterator(copy, {}, seq_len=8, global_batch=2, seed=0)
    train.unlink()
    with pytest.raises(DataError, match="missing"):
        load_meta(copy)
    meta = load_meta(prepared)
    sources = {n: s["train"]["spec"] for n, s in meta["sources"].items() if "train" in s}
    val = {n: s["val"]["spec"] for n, s in meta["sources"].items() if s["val"]["from"] == "files"}
    again = dict(sources=sources, val=val, vocab_size=1024, val_fraction=0.1, progress=False)
    with pytest.raises(DataError, match="missing.*pass --overwrite to prepare it again"):
        prepare(copy, **again)
    assert prepare(copy, **again, overwrite=True)["sources"]["wiki"]["train"]["tokens"] == len(data) // 2
    train.write_bytes(data[:-2])
    (copy / "meta.json").unlink()
    with pytest.raises(DataError, match="never prepared"):
        load_meta(copy)
    with pytest.raises(DataError, match="does not exist") as missing:
        load_meta(tmp_path / "nowhere")
    assert f"python -m launch.prepare_data --out {tmp_path / 'nowhere'} --source NAME=" in str(missing.value) and "..." not in str(missing.value)


def test_a_cpu_config_without_its_data_names_the_whole_command(tmp_path, monkeypatch, capsys):
    """The error a new user meets on the README's CPU commands carries a command to paste."""
    from fibjax.recipes import PREPARE_CPU
    from launch.train import main

    monkeypatch.chdir(tmp_path)  # data/cpu is relative: absent here
    assert main(["--config", str(Path(__file__).parents[1] / "configs" / "cpu" / "fib_stagger_w12.py"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data directory 'data/cpu' does not exist;") and err.rstrip().endswith(PREPARE_CPU) and "..." not in err
    assert PREPARE_CPU.startswith("python -m launch.prepare_data --out data/cpu ") and not (tmp_path / "runs").exists()


def test_bad_inputs_are_errors_naming_the_file(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n ")
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (tmp_path / "doc.csv").write_text("a,b\n")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    cases = [
        ("empty.jsonl", "empty.jsonl.*holds no document"),
        ("blank.txt", "blank.txt.*holds no document"),
        ("notext.jsonl", "notext.jsonl:1: expected .*'text'"),
        ("broken.jsonl", "broken.jsonl:2: not valid JSON"),
        ("doc.csv", "doc.csv.*unsupported file type"),
        ("bad.jsonl.gz", "cannot read .*bad.jsonl.gz"),
        ("missing.jsonl", "missing.jsonl' does not exist"),
        ("nothing_*.jsonl", "no file matches"),
    ]
    for name, message in cases:
        with pytest.raises(DataError, match=message):
            prepare(out, {"x": str(tmp_path / name)}, vocab_size=512, progress=False)
    assert not (out / "meta.json").exists()
    with pytest.raises(DataError, match="needs a budget"):
        prepare(out, {"web": "hf:HuggingFaceFW/fineweb-edu:sample-10BT"}, progress=False)
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="'datasets' package"):
            prepare(out, {"web": "hf:HuggingFaceFW/fineweb-edu:sample-10BT"}, max_docs=10, progress=False)
    with pytest.raises(DataError, match="source name 'meta.json'"):
        prepare(out, {"meta.json": str(tmp_path / "empty.jsonl")}, progress=False)
    assert prepare_data.main(["--out", str(out), "--source", f"x={tmp_path / 'missing.jsonl'}", "--quiet"]) == 2


def test_txt_and_parquet_inputs(tmp_path):
    docs = embedded_documents()
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text(docs[0])  # one document per file, blank lines included
    (folder / "b.txt").write_text("<|endoftext|>".join(docs[1:4]))  # split on the marker
    pq.write_table(pa.table({"text": docs[4:40], "id": list(range(36))}), tmp_path / "docs.parquet")
    assert list(read_documents(str(folder))) == docs[:4]
    out = tmp_path / "out"
    meta = prepare(out, {"txt": str(folder), "pq": str(tmp_path / "docs.parquet")}, {"txt": f"{folder / 'a.txt'}"}, vocab_size=700, progress=False)
    tok = Tokenizer.load(out / "tokenizer.model")
    assert documents_in(np.fromfile(out / "txt" / "train.bin", np.uint16), tok) == docs[:4]
    pq_docs = documents_in(np.fromfile(out / "pq" / "train.bin", np.uint16), tok) + documents_in(validation_tokens(out, "pq"), tok)
    assert sorted(pq_docs) == sorted(docs[4:40])
    assert meta["sources"]["pq"]["val"]["documents"] >= 1
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "wrong.parquet")
    with pytest.raises(DataError, match="wrong.parquet.*no 'text' column"):
        prepare(tmp_path / "o2", {"x": str(tmp_path / "wrong.parquet")}, vocab_size=512, progress=False)


def test_embedded_default_corpus_prepares_offline_and_once(tmp_path):
    meta = prepare_default(tmp_path / "data", vocab_size=2048)
    source = meta["sources"]["python_docs"]
    assert source["train"]["spec"] == EMBEDDED_SPEC and source["train"]["tokens"] > 50_000
    assert source["val"]["documents"] >= 3 and source["val"]["tokens"] > 1_000
    stamp = (tmp_path / "data" / "python_docs" / "train.bin").stat().st_mtime_ns
    assert prepare_default(tmp_path / "data", vocab_size=2048) == meta
    assert (tmp_path / "data" / "python_docs" / "train.bin").stat().st_mtime_ns == stamp
    with pytest.raises(DataError, match="other inputs"):
        prepare_default(tmp_path / "data", vocab_size=1024)
    batch = next(train_iterator(tmp_path / "data", {}, seq_len=256, global_batch=4, seed=0))
    assert batch.shape == (4, 257) and batch.dtype == np.int32


# ---- pipeline -------------------------------------------------------------------------


def take(it, n):
    return [next(it) for _ in range(n)]


def test_pipeline_is_deterministic_and_windows_are_real_slices(prepared):
    batches = take(train_iterator(prepared, {}, seq_len=32, global_batch=8, seed=3), 3)
    again = take(train_iterator(prepared, {}, seq_len=32, global_batch=8, seed=3), 3)
    other = take(train_iterator(prepared, {}, seq_len=32, global_batch=8, seed=4), 3)
    assert all(b.shape == (8, 33) and b.dtype == np.int32 for b in batches)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))
    assert not any(np.array_equal(a, b) for a, b in zip(batches, other))
    files = {n: np.fromfile(prepared / n / "train.bin", np.uint16) for n in ("web", "wiki")}
    for row in np.concatenate(batches):
        assert sum(len(window_offsets(t, row)) for t in files.values()) >= 1


def test_a_batch_of_one_is_the_first_row_of_a_batch_of_two(prepared):
    """One sequence per step is a valid run (a 1-device debug run): grain's batch length of an
    endless dataset overflowed for a batch of one. Batching does not reorder windows."""
    ones = take(train_iterator(prepared, {}, seq_len=16, global_batch=1, seed=5), 4)
    twos = take(train_iterator(prepared, {}, seq_len=16, global_batch=2, seed=5), 2)
    assert all(b.shape == (1, 17) for b in ones)
    assert np.array_equal(np.concatenate(ones), np.concatenate(twos))


@pytest.mark.parametrize("worker_count", [0, 2])
def test_resume_from_state_gives_the_same_next_batches(prepared, worker_count):
    kwargs = dict(seq_len=16, global_batch=4, seed=0, worker_count=worker_count)
    it = train_iterator(prepared, {}, **kwargs)
    take(it, 5)
    state = it.get_state()
    expected = take(it, 4)
    resumed = train_iterator(prepared, {}, **kwargs)
    resumed.set_state(state)
    assert all(np.array_equal(a, b) for a, b in zip(expected, take(resumed, 4)))


def test_iterator_state_round_trips_through_orbax(prepared, tmp_path):
    import orbax.checkpoint as ocp

    it = train_iterator(prepared, {}, seq_len=16, global_batch=4, seed=1)
    take(it, 3)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
        expected = take(it, 2)
        resumed = train_iterator(prepared, {}, seq_len=16, global_batch=4, seed=1)
        manager.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
    assert all(np.array_equal(a, b) for a, b in zip(expected, take(resumed, 2)))


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_are_disjoint_and_make_up_the_global_batch(prepared, process_count):
    kwargs = dict(seq_len=16, global_batch=8, seed=7)
    single = take(train_iterator(prepared, {}, **kwargs), 3)
    shards = [take(train_iterator(prepared, {}, process_index=p, process_count=process_count, **kwargs), 3) for p in range(process_count)]
    for step, full in enumerate(single):
        parts = [shard[step] for shard in shards]
        assert all(p.shape == (8 // process_count, 17) for p in parts)
        assert np.array_equal(np.concatenate(parts), full)


def test_mixture_weights_are_respected(prepared):
    meta = load_meta(prepared)
    files = {n: np.fromfile(prepared / n / "train.bin", np.uint16) for n in ("web", "wiki")}
    tokens = {n: meta["sources"][n]["train"]["tokens"] for n in files}
    for weights, expected in [({"web": 0.8, "wiki": 0.2}, 0.8), ({}, tokens["web"] / sum(tokens.values())), ({"wiki": 1.0}, 0.0)]:
        rows = np.concatenate(take(train_iterator(prepared, weights, seq_len=24, global_batch=100, seed=11), 6))
        from_web = np.mean([len(window_offsets(files["web"], r)) > 0 for r in rows])
        assert abs(from_web - expected) < 0.01, (weights, from_web, expected)  # Grain's mix interleaves exactly, not by draws


def test_pipeline_argument_errors(prepared):
    with pytest.raises(DataError, match="not divisible by the number of processes 3"):
        train_iterator(prepared, {}, seq_len=8, global_batch=8, seed=0, process_count=3)
    with pytest.raises(DataError, match=r"unknown training source\(s\) \['books'\]"):
        train_iterator(prepared, {"books": 1.0}, seq_len=8, global_batch=2, seed=0)
    with pytest.raises(DataError, match=r"unknown training source\(s\) \['stories'\]"):  # validation only
        train_iterator(prepared, {"stories": 1.0}, seq_len=8, global_batch=2, seed=0)
    wiki_tokens = load_meta(prepared)["sources"]["wiki"]["train"]["tokens"]
    with pytest.raises(DataError, match="'wiki' has .* fewer than seq_len \\+ 1"):
        train_iterator(prepared, {}, seq_len=wiki_tokens, global_batch=2, seed=0)
    with pytest.raises(DataError, match=r"unknown source 'nope'.*\['stories', 'web', 'wiki'\]"):
        validation_tokens(prepared, "nope")


def test_max_tokens_stops_at_the_document_that_reaches_the_budget(corpus, prepared, tmp_path):
    """The budget is checked per document, not per encoding batch: the split ends with the
    first document that reaches it (kept whole), so it overshoots by less than one document."""
    out = tmp_path / "budget"
    tok = Tokenizer.load(prepared / "tokenizer.model")
    budget = load_meta(prepared)["sources"]["web"]["train"]["tokens"] // 2
    meta = prepare(out, {"web": str(corpus["web"])}, tokenizer=str(prepared / "tokenizer.model"), max_tokens=budget, val_fraction=0.1, progress=False)
    train = meta["sources"]["web"]["train"]
    docs = [d for d in corpus["docs"]["web"] if not is_held_out(d, 0.1)][: train["documents"]]
    lengths = [len(tok.encode(d)) + 1 for d in docs]
    assert sum(lengths) == train["tokens"] >= budget
    assert sum(lengths[:-1]) < budget  # without its last document the split is under the budget
