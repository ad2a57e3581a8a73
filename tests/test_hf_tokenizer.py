"""Hugging Face tokenizers behind fibjax's tokenizer interface, and data prepared with them.

Every tokenizer here is built in the test (no network): a byte-level BPE ``tokenizer.json``
trained on a few sentences, whose post-processor prepends BOS as Llama 3's does, in a model
directory whose tokenizer_config.json names BOS and EOS.
"""

import hashlib
import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from fibjax.data import DataError, Tokenizer, TokenizerError, load_meta, load_tokenizer, prepare, train_tokenizer
from fibjax.data.hf_tokenizer import HFTokenizer
from fibjax.data.sentencepiece_tokenizer import SentencePieceTokenizer
from fibjax.data.sources import embedded_documents
from fibjax.data.token_files import data_tokenizer, token_dtype
from launch import prepare_data

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXTS = ["Hello ünïcödé 中文 🙂\n\n  two  spaces\tand a tab ", "The quick brown fox.", " leading space", "x"]


def byte_level_bpe(corpus: list[str], *, prepend_bos: bool = True) -> RustTokenizer:
    """A tiny Llama-3-style tokenizer: byte-level BPE (every text round-trips), BOS and EOS as
    special tokens, and (``prepend_bos``) a post-processor that begins every text with BOS."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    if prepend_bos:
        template = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
        tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, manual_documents):
    """A Hugging Face model directory: tokenizer.json + tokenizer_config.json naming BOS/EOS."""
    directory = tmp_path_factory.mktemp("hf_model")
    byte_level_bpe(manual_documents[:50]).save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": {"__type": "AddedToken", "content": EOS, "special": True}, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_a_model_directory_gives_its_special_tokens_and_round_trips_text(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer) and tok.file_name == "tokenizer.json"
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (0, 1, True, 400)
    assert tok.document_start == [tok.bos_id]
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.bos_id not in ids and tok.decode(ids) == text  # encode adds no special token
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.decode([tok.bos_id, *tok.encode("a"), tok.eos_id]) == f"{BOS}a{EOS}"  # decode skips nothing
    assert load_tokenizer(hf_dir / "tokenizer.json").sha256 == tok.sha256 == Tokenizer.load(hf_dir).sha256


def test_sha256_covers_side_settings_and_survives_save(hf_dir, tmp_path):
    tok = load_tokenizer(hf_dir)
    saved = load_tokenizer(tok.save(tmp_path / "saved"))
    assert saved.sha256 == tok.sha256 and saved.special == tok.special
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    # the file alone: its own post-processor's BOS, no EOS; the sha is the bytes' (as before side files)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(hf_dir / "tokenizer.json", bare)
    (bare / "config.json").write_text(json.dumps({"eos_token_id": 1}))  # the same EOS, written as an id
    by_id = load_tokenizer(bare)
    assert by_id.special == tok.special and by_id.sha256 == tok.sha256
    (bare / "config.json").unlink()
    with pytest.raises(TokenizerError, match="names no EOS token.*tokenizer_config.json"):
        load_tokenizer(bare)
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": BOS}))  # another EOS: another sha
    assert load_tokenizer(bare).eos_id == 0 and load_tokenizer(bare).sha256 != tok.sha256


def test_special_tokens_follow_the_source_models_files(hf_dir, tmp_path):
    """Qwen2 says ``bos_token: null`` in tokenizer_config.json while config.json names an id;
    ``add_bos_token`` overrides the post-processor; chat models list several EOS ids."""
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    byte_level_bpe(TEXTS, prepend_bos=False).save(str(qwen / "tokenizer.json"))
    (qwen / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": EOS}))
    (qwen / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 0}))
    tok = load_tokenizer(qwen)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.document_start) == (None, 1, False, [])
    off = tmp_path / "off"
    shutil.copytree(hf_dir, off)
    (off / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "add_bos_token": False}))
    assert load_tokenizer(off).add_bos is False and load_tokenizer(off).bos_id == 0
    (off / "tokenizer_config.json").unlink()
    (off / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    assert load_tokenizer(off).eos_id == 1 and load_tokenizer(off).add_bos is True


def test_sentencepiece_in_a_model_directory(tmp_path):
    """A tokenizer.model with a tokenizer_config.json beside it (Llama 2's layout)."""
    sp = train_tokenizer(embedded_documents()[:20], 400)
    plain = tmp_path / "plain"
    sp.save(plain)
    assert load_tokenizer(plain).sha256 == hashlib.sha256((plain / "tokenizer.model").read_bytes()).hexdigest() == sp.sha256
    llama = tmp_path / "llama"
    sp.save(llama)
    (llama / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "add_bos_token": False}))
    tok = load_tokenizer(llama)
    assert isinstance(tok, SentencePieceTokenizer) and (tok.eos_id, tok.bos_id, tok.add_bos) == (1, None, False)
    assert tok.sha256 != sp.sha256 and load_tokenizer(tok.save(tmp_path / "again")).sha256 == tok.sha256


def test_bad_tokenizers_get_one_line(hf_dir, tmp_path):
    def one_line(path) -> str:
        with pytest.raises(TokenizerError) as caught:
            load_tokenizer(path)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "does not exist" in one_line(tmp_path / "nope" / "tokenizer.json")
    (tmp_path / "empty").mkdir()
    assert "holds neither tokenizer.json nor tokenizer.model" in one_line(tmp_path / "empty")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    assert "is not a valid Hugging Face tokenizer.json" in one_line(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_bytes(b"\xff\xfe")
    assert "is not a valid Hugging Face tokenizer.json" in one_line(tmp_path / "tokenizer.json")
    (tmp_path / "vocab.txt").write_text("a")
    assert "expected a SentencePiece .model" in one_line(tmp_path / "vocab.txt")
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    (bad / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    assert "its eos token '<|eot_id|>' is not in the vocabulary" in one_line(bad)
    (bad / "tokenizer_config.json").write_text("{")
    assert "is not readable JSON" in one_line(bad)


def _documents(tokens: np.ndarray, tok: Tokenizer) -> list[list[int]]:
    ends = np.flatnonzero(tokens == tok.eos_id)
    assert ends.size and ends[-1] == len(tokens) - 1
    return [doc.tolist() for doc in np.split(tokens, ends + 1)[:-1]]


def test_prepare_data_with_a_model_directory(hf_dir, manual_documents, tmp_path, capsys):
    """``launch.prepare_data --tokenizer DIR``: each document is BOS + encode(text) + EOS, and
    the data directory holds the tokenizer under its own name, loadable with the same sha."""
    docs = manual_documents[:30]
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:20]))
    (tmp_path / "notes").mkdir()
    for i, d in enumerate(docs[20:]):
        (tmp_path / "notes" / f"{i:02d}.txt").write_text(d)
    out = tmp_path / "data"
    argv = ["--out", str(out), "--tokenizer", str(hf_dir), "--source", f"web={tmp_path / 'web.jsonl'}", "--val", f"web={tmp_path / 'notes'}", "--quiet"]
    assert prepare_data.main(argv) == 0, capsys.readouterr().err
    meta = load_meta(out)
    tok = load_tokenizer(hf_dir)
    assert meta["tokenizer"] | {"from": None} == {
        "file": "tokenizer.json",
        "sha256": tok.sha256,
        "vocab_size": 400,
        "eos_id": 1,
        "bos_id": 0,
        "add_bos": True,
        "from": None,
    }
    assert meta["dtype"] == "uint16" and sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "tokenizer_config.json", "web"]
    assert data_tokenizer(out).sha256 == tok.sha256
    train = np.fromfile(out / "web" / "train.bin", np.uint16)
    assert _documents(train, tok) == [[tok.bos_id, *tok.encode(d), tok.eos_id] for d in docs[:20]]
    val = np.fromfile(out / "web" / "val.bin", np.uint16)
    assert [tok.decode(d[1:-1]) for d in _documents(val, tok)] == docs[20:]
    assert prepare_data.main(argv) == 0  # the same inputs again: nothing to do
    # the data directory is a tokenizer directory too (validation data for runs on it)
    assert load_tokenizer(out).sha256 == tok.sha256


def test_a_vocabulary_past_uint16_is_stored_as_uint32(manual_documents, tmp_path):
    """Llama 3's 128,256 ids: BOS and EOS at 128,000 and 128,001, as there."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))} | {f"<filler_{i}>": i for i in range(len(alphabet), 128_000)}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, *(f"<|reserved_{i}|>" for i in range(254))])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}))
    big = load_tokenizer(tmp_path)
    assert (big.vocab_size, big.bos_id, big.eos_id) == (128_256, 128_000, 128_001) and token_dtype(big.vocab_size) == np.uint32
    (tmp_path / "doc.txt").write_text(manual_documents[0])
    meta = prepare(tmp_path / "data", {}, {"doc": str(tmp_path / "doc.txt")}, tokenizer=tmp_path, progress=False)
    assert meta["dtype"] == "uint32"
    tokens = np.fromfile(tmp_path / "data" / "doc" / "val.bin", np.uint32).tolist()
    assert tokens == [128_000, *big.encode(manual_documents[0]), 128_001]
    load_meta(tmp_path / "data")  # every id below the vocabulary


def test_a_sentencepiece_data_directory_from_before_keeps_working(hf_dir, tmp_path, manual_documents):
    """meta.json without the tokenizer's file name, BOS or add_bos (prepared before tokenizer.json
    was accepted): the tokenizer.model there loads, with its sha, and no BOS."""
    (tmp_path / "docs.txt").write_text(manual_documents[0])
    old = tmp_path / "old"
    meta = prepare(old, {}, {"docs": str(tmp_path / "docs.txt")}, tokenizer=_sentencepiece(tmp_path), progress=False)
    for key in ("file", "bos_id", "add_bos"):
        del meta["tokenizer"][key]
    (old / "meta.json").write_text(json.dumps(meta))
    tok = data_tokenizer(old)
    assert isinstance(tok, SentencePieceTokenizer) and tok.sha256 == load_meta(old)["tokenizer"]["sha256"] and tok.document_start == []
    (old / "tokenizer.model").write_bytes(b"junk")
    with pytest.raises(DataError, match="tokenizer mismatch.*does not load"):
        load_meta(old)
    # prepared again with a Hugging Face tokenizer: the old tokenizer.model goes
    prepare(old, {}, {"docs": str(tmp_path / "docs.txt")}, tokenizer=hf_dir, progress=False, overwrite=True)
    assert not (old / "tokenizer.model").exists() and isinstance(data_tokenizer(old), HFTokenizer)


def _sentencepiece(tmp_path) -> str:
    path = train_tokenizer(embedded_documents()[:20], 400).save(tmp_path / "sp")
    return str(path)


def test_transformers_reads_the_same_ids(hf_dir):
    transformers = pytest.importorskip("transformers", reason='comparing with transformers needs it: pip install -e ".[hf-parity]"')
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ours = load_tokenizer(hf_dir)
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    for text in TEXTS:
        assert theirs(text).input_ids == ours.document_start + ours.encode(text)
        assert theirs.decode(ours.encode(text)) == ours.decode(ours.encode(text)) == text


def test_a_sampled_prompt_begins_a_document_as_the_source_model_did(hf_dir):
    from fibjax.decode.run import encode_prompt

    tok = load_tokenizer(hf_dir)
    assert encode_prompt(tok, "The fox", max_new_tokens=4, limit=None) == [tok.bos_id, *tok.encode("The fox")]
    sp = train_tokenizer(embedded_documents()[:20], 400)  # fibjax's own: no BOS
    assert encode_prompt(sp, "The fox", max_new_tokens=4, limit=None) == sp.encode("The fox")
