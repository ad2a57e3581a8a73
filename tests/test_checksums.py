"""Token files carry a sha256 per shard in meta.json (written by preparation), verified when a run
first uses them and recorded in the run (RUN/data.sha256.json), so a resume hashes nothing
unchanged. Damage within the vocabulary is what only these checksums catch. (The names new with
the checksums are imported in the tests that use them, so that the damage test runs, and
fails, on the code before them.)"""

import json
import os
import shutil

import numpy as np
import pytest

from fibjax.data import DataError, prepare_default, token_files
from fibjax.data.token_files import file_sha256, load_meta
from tests.helpers import TINY_VOCAB, assert_one_error, train_main

TRAIN_FILE = "python_docs/train.bin"


@pytest.fixture
def fresh_data(tmp_path, data_dir):
    """A copy of the prepared embedded corpus, free to damage."""
    out = tmp_path / "data"
    shutil.copytree(data_dir, out)
    return out


def overwrite_in_range(path, token=5, count=200):
    """``count`` tokens in the middle of ``path`` set to an id inside the vocabulary (the issue's damage)."""
    tokens = np.memmap(path, dtype="<u2", mode="r+")
    tokens[len(tokens) // 2 : len(tokens) // 2 + count] = token
    tokens.flush()


def test_preparation_records_each_token_files_sha256(data_dir):
    meta = load_meta(data_dir)
    for source in meta["sources"].values():
        for split in source.values():
            assert split["sha256"] == file_sha256(data_dir / split["file"])


def test_tokens_changed_within_the_vocabulary_are_one_error_naming_the_shard(tmp_path, fresh_data, capsys):
    """200 tokens overwritten with id 5: the size and the id range still pass; before checksums the
    run trained to the end with exit 0."""
    overwrite_in_range(fresh_data / TRAIN_FILE)
    rc, out = train_main(capsys, tmp_path / "run", fresh_data, "steps=2")
    assert_one_error(rc, out, f"token file {fresh_data / TRAIN_FILE} is damaged", "sha256", "--overwrite")
    assert not (tmp_path / "run").exists()  # refused before the workdir was claimed


def test_a_resume_hashes_data_within_the_budget_again_so_an_edit_keeping_size_and_mtime_is_caught(tmp_path, fresh_data, capsys):
    """Before, a resume trusted size and modification time: a shard edited in place with both kept
    trained on silently. The CPU study's 28.6 MiB hash in 0.24-0.31 s (workdir.HASH_EVERY_START_BYTES)."""
    workdir = tmp_path / "run"
    rc, out = train_main(capsys, workdir, fresh_data, "steps=2")
    assert rc == 0, out
    stat = (fresh_data / TRAIN_FILE).stat()
    overwrite_in_range(fresh_data / TRAIN_FILE)
    os.utime(fresh_data / TRAIN_FILE, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    monkeypatch_free_cache()
    rc, out = train_main(capsys, workdir, fresh_data, "steps=4")
    assert_one_error(rc, out, f"{fresh_data / TRAIN_FILE} is damaged")


def monkeypatch_free_cache():
    token_files._VERIFIED.clear()  # as a new process would start


def test_a_resume_of_data_above_the_budget_trusts_size_and_mtime_saying_so_and_hashes_a_changed_file(tmp_path, fresh_data, capsys, monkeypatch):
    from fibjax.run import workdir as workdir_lib

    workdir = tmp_path / "run"
    rc, out = train_main(capsys, workdir, fresh_data, "steps=2")
    assert rc == 0, out
    monkeypatch.setattr(workdir_lib, "HASH_EVERY_START_BYTES", 0)
    monkeypatch.setattr(workdir_lib, "_WARNED", set())
    hashed = []
    monkeypatch.setattr(token_files, "file_sha256", lambda path: hashed.append(path) or file_sha256(path))
    monkeypatch.setattr(token_files, "_VERIFIED", {})
    rc, out = train_main(capsys, workdir, fresh_data, "steps=3")
    assert rc == 0 and not [p for p in hashed if p.suffix == ".bin"], (hashed, out)  # the tokenizer (small) is hashed at every start
    assert out.count("are trusted by their size and modification time") == 1, out
    overwrite_in_range(fresh_data / TRAIN_FILE)
    rc, out = train_main(capsys, workdir, fresh_data, "steps=4")
    assert_one_error(rc, out, f"{fresh_data / TRAIN_FILE} is damaged")


def test_another_corpus_in_place_of_the_data_is_refused_naming_the_shard_and_the_record_is_kept(tmp_path, fresh_data, capsys):
    """Before, a data.path directory replaced by another corpus (same tokenizer) resumed silently
    and data.sha256.json was rewritten with the new hashes, erasing the evidence."""
    from fibjax.run.workdir import DATA_RECORD

    workdir = tmp_path / "run"
    rc, out = train_main(capsys, workdir, fresh_data, "steps=2")
    assert rc == 0, out
    record = (workdir / DATA_RECORD).read_text()
    overwrite_in_range(fresh_data / TRAIN_FILE)  # other tokens, and a meta.json that vouches for them
    meta = json.loads((fresh_data / "meta.json").read_text())
    name, split = TRAIN_FILE.split("/")[0], TRAIN_FILE.split("/")[1].split(".")[0]
    meta["sources"][name][split]["sha256"] = file_sha256(fresh_data / TRAIN_FILE)
    (fresh_data / "meta.json").write_text(json.dumps(meta))
    monkeypatch_free_cache()
    rc, out = train_main(capsys, workdir, fresh_data, "steps=4")
    assert_one_error(rc, out, "is not the data the run in", f"token file {TRAIN_FILE} with sha256", "Point data.path at the data the run trained on")
    assert (workdir / DATA_RECORD).read_text() == record


def test_data_prepared_before_checksums_works_with_one_warning_and_preparing_again_adds_them(tmp_path, fresh_data, capsys):
    from fibjax.data.token_files import verify_checksums

    meta = json.loads((fresh_data / "meta.json").read_text())
    for source in meta["sources"].values():
        for split in source.values():
            del split["sha256"]
    (fresh_data / "meta.json").write_text(json.dumps(meta))
    workdir = tmp_path / "run"
    rc, out = train_main(capsys, workdir, fresh_data, "steps=2")
    assert rc == 0 and out.count("records no checksums") == 1, out
    rc, out = train_main(capsys, workdir, fresh_data, "steps=3")
    assert rc == 0 and "records no checksums" not in out, out  # once per run
    prepare_default(fresh_data, vocab_size=TINY_VOCAB)
    assert "recorded the sha256 of 2 token file(s)" in capsys.readouterr().err
    assert verify_checksums(fresh_data, load_meta(fresh_data))[TRAIN_FILE]["sha256"] == file_sha256(fresh_data / TRAIN_FILE)


def test_preparing_damaged_data_again_refuses_it_saying_how_to_prepare_it_again(fresh_data):
    """The same command on damaged data is no longer "nothing to do"; the embedded corpus's
    remedy is its own (launch.prepare_data's is --overwrite)."""
    overwrite_in_range(fresh_data / TRAIN_FILE)
    with pytest.raises(DataError, match=r"train.bin is damaged: .*\(bytes changed on disk\); delete .* and run the same command again"):
        prepare_default(fresh_data, vocab_size=TINY_VOCAB)
