"""What an import checks before it trusts a Hugging Face checkpoint, and what it leaves behind.

Every damaged file is built here by hand, byte by byte (an 8-byte little-endian header length,
the JSON header, the data), from a small model written without torch (``tests.hf_models``), so
the fast tier runs them all. Each refusal is one UnsupportedModel naming the file or field and
the tensor, and leaves no run.
"""

import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from fibjax.config import AttentionConfig, to_dict
from fibjax.hf import UnsupportedModel, export_model, import_model, plan_import, safetensors
from fibjax.hf.convert import IMPORTING
from tests import hf_models

NORM = "model.norm.weight"


def _parts(path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _raw(path, header, data: bytes) -> None:
    """A safetensors file exactly as given: no check, no padding."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit(model_dir, change) -> None:
    """Rewrite model.safetensors with ``change(header, data) -> (header, data)``."""
    path = model_dir / "model.safetensors"
    _raw(path, *change(*_parts(path)))


def _arrays(model_dir) -> dict[str, np.ndarray]:
    return {n: np.array(r.map()) for n, r in safetensors.read_header(model_dir / "model.safetensors").items()}


def _write_arrays(model_dir, arrays: dict) -> None:
    safetensors.write(model_dir / "model.safetensors", [(n, a.dtype, a.shape, lambda a=a: a) for n, a in arrays.items()])


def _refused(tmp_path, model_dir, *expected: str) -> str:
    """The import's one error names every string in ``expected``; nothing is written."""
    with pytest.raises(UnsupportedModel) as caught:
        import_model(model_dir, tmp_path / "run")
    message = str(caught.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no run, no temporary directory
    return message


@pytest.fixture
def model_dir(tmp_path):
    return hf_models.handmade(tmp_path / "model")


# --- the safetensors header, as strictly as the format's own library reads it -------------------


def _offsets(name, begin, end):
    def change(header, data):
        header[name]["data_offsets"] = [begin, end]
        return header, data

    return change


def _negative(header, data):
    nbytes = header[NORM]["data_offsets"][1] - header[NORM]["data_offsets"][0]
    return _offsets(NORM, -nbytes, 0)(header, data)  # the header's own bytes, read as the norm's


def _very_negative(header, data):
    nbytes = header[NORM]["data_offsets"][1] - header[NORM]["data_offsets"][0]
    return _offsets(NORM, -(10**15), -(10**15) + nbytes)(header, data)


def _overlapping(header, data):
    return _offsets(NORM, *header["model.layers.0.input_layernorm.weight"]["data_offsets"])(header, data)


def _gap(header, data):
    del header["model.layers.0.input_layernorm.weight"]  # its bytes stay, between two tensors: no tensor claims them
    return header, data


def _extra_bytes(header, data):
    return header, data + b"\0" * 8


def _short_data(header, data):
    return header, data[:-4]


def _end_before_begin(header, data):
    begin, end = header[NORM]["data_offsets"]
    return _offsets(NORM, end, begin)(header, data)


def _float_offsets(header, data):
    begin, end = header[NORM]["data_offsets"]
    return _offsets(NORM, float(begin), end)(header, data)


def _header_a_list(header, data):
    return [header], data


def _shape_disagrees(header, data):
    header[NORM]["shape"] = [header[NORM]["shape"][0] * 2]
    return header, data


def _dtype_disagrees(header, data):
    header[NORM]["dtype"] = "F16"  # half the bytes the offsets give
    return header, data


def _unknown_dtype(header, data):
    header[NORM]["dtype"] = "F8_E4M3"
    return header, data


def _metadata_not_strings(header, data):
    return {**header, "__metadata__": {"format": 1}}, data


def _no_offsets(header, data):
    del header[NORM]["data_offsets"]
    return header, data


DAMAGE = [
    (_negative, [NORM, "non-negative"]),
    (_very_negative, [NORM, "non-negative"]),
    (_overlapping, [NORM, "overlaps 'model.layers.0.input_layernorm.weight'"]),
    (_gap, ["unclaimed after"]),
    (_extra_bytes, ["bytes no tensor claims"]),
    (_short_data, ["truncated"]),
    (_end_before_begin, [NORM, "end before they begin"]),
    (_float_offsets, [NORM, "non-negative integers"]),
    (_header_a_list, ["the header is a JSON list"]),
    (_shape_disagrees, [NORM, "needs 512"]),
    (_dtype_disagrees, [NORM, "F16 needs 128"]),
    (_unknown_dtype, [NORM, "'F8_E4M3'"]),
    (_metadata_not_strings, ["__metadata__"]),
    (_no_offsets, [NORM, "lacks dtype, shape or data_offsets"]),
]


@pytest.mark.parametrize("damage, expected", DAMAGE, ids=[d.__name__[1:] for d, _ in DAMAGE])
def test_a_damaged_safetensors_header_is_one_error_naming_file_and_tensor(tmp_path, model_dir, damage, expected):
    _edit(model_dir, damage)
    _refused(tmp_path, model_dir, str(model_dir / "model.safetensors"), *expected)


def test_the_safetensors_library_refuses_every_damaged_file_too(tmp_path, model_dir):
    """The format's own reader as the oracle (installed with the hf-parity extra): each file
    above is one it refuses as well, so none of these refusals is stricter than the format."""
    reference = pytest.importorskip("safetensors", reason=hf_models.PARITY_EXTRA)
    path = model_dir / "model.safetensors"
    intact = path.read_bytes()
    for damage, _ in DAMAGE:
        path.write_bytes(intact)
        _edit(model_dir, damage)
        with pytest.raises(reference.SafetensorError):
            with reference.safe_open(path, "numpy") as f:
                [f.get_tensor(k) for k in f.keys()]


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    model_dir = hf_models.handmade(tmp_path / "model", shards=2)
    first, second = sorted(model_dir.glob("model-*.safetensors"))
    arrays = {n: np.array(r.map()) for n, r in safetensors.read_header(second).items()}
    name = next(iter(safetensors.read_header(first)))
    arrays[name] = np.array(safetensors.read_header(first)[name].map())
    safetensors.write(second, [(n, a.dtype, a.shape, lambda a=a: a) for n, a in arrays.items()])
    _refused(tmp_path, model_dir, f"tensor {name!r} is stored twice")


def test_the_untouched_file_imports_and_metadata_is_allowed(tmp_path, model_dir):
    _edit(model_dir, lambda header, data: ({**header, "__metadata__": {"format": "pt"}}, data))
    import_model(model_dir, tmp_path / "run")
    assert (tmp_path / "run" / "config.json").is_file()


# --- values: non-finite weights, tied heads ---------------------------------------------------


@pytest.mark.parametrize("value, dtype", [(np.nan, np.float32), (np.inf, np.float32), (-np.inf, "bfloat16")], ids=["nan", "inf", "bf16-minus-inf"])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, model_dir, value, dtype):
    arrays = {n: a.astype(safetensors.DTYPES["BF16"] if dtype == "bfloat16" else a.dtype) for n, a in _arrays(model_dir).items()}
    name = "model.layers.1.mlp.up_proj.weight"
    arrays[name][3, 5] = value
    _write_arrays(model_dir, arrays)
    _refused(tmp_path, model_dir, repr(name), "1 NaN or infinite value")


def _tied_with_head(tmp_path, head_of):
    model_dir = hf_models.handmade(tmp_path / "model", tie=True)
    arrays = _arrays(model_dir)
    arrays["lm_head.weight"] = head_of(arrays["model.embed_tokens.weight"])
    _write_arrays(model_dir, arrays)
    return model_dir


def test_a_tied_model_that_stores_another_head_is_refused_by_name(tmp_path):
    model_dir = _tied_with_head(tmp_path, lambda table: table + np.float32(1e-3))
    message = _refused(tmp_path, model_dir, "tie_word_embeddings: true", "'lm_head.weight' differs from 'model.embed_tokens.weight'")
    assert "set tie_word_embeddings to false" in message


def test_a_tied_model_that_stores_its_table_twice_imports_tied(tmp_path):
    model_dir = _tied_with_head(tmp_path, lambda table: table.copy())
    assert import_model(model_dir, tmp_path / "run").model.tie_embeddings


# --- config.json: presence and type of every field read; both RoPE layouts ----------------------


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"hidden_size": None}, "the field 'hidden_size' is missing"),
        ({"num_attention_heads": None}, "the field 'num_attention_heads' is missing"),
        ({"num_attention_heads": "4"}, "num_attention_heads='4' is not a positive integer"),
        ({"num_attention_heads": 4.0}, "num_attention_heads=4.0 is not a positive integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers=True is not a positive integer"),
        ({"vocab_size": -320}, "vocab_size=-320 is not a positive integer"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5' is not a positive number"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' is not true or false"),
        ({"rope_scaling": [2.0]}, "rope_scaling=[2.0] is not a JSON object"),
        ({"rope_scaling": {"rope_type": "linear"}}, "the field 'rope_scaling.factor' is missing"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_parameters.rope_theta='1e4'"),
        ({"num_attention_heads": 3}, "config.json describes no model fibjax can build"),
    ],
)
def test_a_config_field_missing_or_of_the_wrong_type_is_one_line(tmp_path, change, expected):
    model_dir = hf_models.handmade(tmp_path / "model")
    config = {**json.loads((model_dir / "config.json").read_text()), **change}
    (model_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    _refused(tmp_path, model_dir, expected)


@pytest.mark.parametrize(
    "change",
    [{"rope_scaling": {"rope_type": "default"}, "rope_theta": 5e5}, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}],
    ids=["rope_scaling", "rope_parameters"],
)
def test_rope_type_default_is_no_scaling_in_both_layouts(tmp_path, change):
    model_dir = hf_models.handmade(tmp_path / "model", **change)
    _, cfg, _, _ = plan_import(model_dir)
    assert (cfg.model.rope_scaling, cfg.model.rope_theta) == ("none", 5e5)


# --- an exported Fibonacci model imports as one --------------------------------------------------


def _with_attention(model_dir, fields) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "fibjax_attention": fields}))


def test_an_exported_fibonacci_model_reimports_with_its_attention(tmp_path, model_dir):
    import_model(model_dir, tmp_path / "run")
    export_model(tmp_path / "run", tmp_path / "dense-hf")
    assert "fibjax_attention" not in json.loads((tmp_path / "dense-hf" / "config.json").read_text())
    attention = AttentionConfig(kind="offset", alpha="staggered", window=4, max_rung=21)
    _with_attention(tmp_path / "dense-hf", {**to_dict(attention), "ssa": False})  # as export writes it for such a model
    cfg = import_model(tmp_path / "dense-hf", tmp_path / "fib")
    assert cfg.model.attention == attention
    export_model(tmp_path / "fib", tmp_path / "fib-hf")
    written = json.loads((tmp_path / "fib-hf" / "config.json").read_text())["fibjax_attention"]
    assert written == json.loads(json.dumps({**to_dict(attention), "ssa": False}))
    assert import_model(tmp_path / "fib-hf", tmp_path / "again").model.attention == attention


def test_an_attention_whose_parameters_were_not_exported_is_refused_with_the_way_out(tmp_path, model_dir):
    _with_attention(model_dir, {"kind": "offset", "alpha": "learned", "learn_alpha": True, "ssa": False})
    _refused(tmp_path, model_dir, "fibjax_attention (kind offset) needs parameters", "remove fibjax_attention")


def test_an_unknown_fibjax_attention_field_is_one_line(tmp_path, model_dir):
    _with_attention(model_dir, {"kind": "offset", "windw": 4})
    _refused(tmp_path, model_dir, "fibjax_attention", "'windw'")


# --- the export keeps the source's side files -----------------------------------------------------

SIDE = {
    "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"},
    "generation_config.json": {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9},
}
CHAT = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


def test_the_export_writes_the_sources_side_files_back_as_they_came(tmp_path, model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.update(chat_template=CHAT, pad_token="</s>", model_max_length=64)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    for name, content in SIDE.items():
        (model_dir / name).write_text(json.dumps(content))
    import_model(model_dir, tmp_path / "run")
    export_model(tmp_path / "run", tmp_path / "exported")
    for name in ("tokenizer_config.json", *SIDE):
        assert (tmp_path / "exported" / name).read_bytes() == (model_dir / name).read_bytes(), name
    exported = json.loads((tmp_path / "exported" / "tokenizer_config.json").read_text())
    assert (exported["chat_template"], exported["pad_token"], exported["unk_token"], exported["tokenizer_class"]) == (
        CHAT,
        "</s>",
        "<unk>",
        "PreTrainedTokenizerFast",
    )
    import_model(tmp_path / "exported", tmp_path / "again")  # the same tokenizer, pinned by the same sha256
    assert (tmp_path / "again" / "tokenizer.sha256").read_text() == (tmp_path / "run" / "tokenizer.sha256").read_text()


def test_side_files_that_no_longer_say_the_runs_tokens_are_updated_in_those_keys_only(tmp_path, model_dir):
    import_model(model_dir, tmp_path / "run")
    side = tmp_path / "run" / "hf_files" / "tokenizer_config.json"
    kept = json.loads(side.read_text())
    side.write_text(json.dumps({**kept, "eos_token": "<unk>", "chat_template": CHAT}))
    export_model(tmp_path / "run", tmp_path / "exported")
    exported = json.loads((tmp_path / "exported" / "tokenizer_config.json").read_text())
    assert exported == {**kept, "eos_token": "</s>", "chat_template": CHAT, "add_bos_token": True}


# --- an import is written aside and renamed into place -------------------------------------------


def test_an_import_that_fails_while_writing_leaves_nothing(tmp_path, model_dir, monkeypatch):
    from fibjax.run import checkpoints

    def fail(self, *args, **kwargs):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(checkpoints.Checkpointer, "save", fail)
    with pytest.raises(RuntimeError, match="disk gone"):
        import_model(model_dir, tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_killed_imports_leftovers_are_cleared_and_a_live_ones_kept(tmp_path, model_dir):
    import socket

    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True).stdout.strip()
    stale, live = tmp_path / f".run{IMPORTING}{host}-{dead}", tmp_path / f".run{IMPORTING}{host}-{os.getppid()}"
    for leftover in (stale, live):
        (leftover / "checkpoints").mkdir(parents=True)
    import_model(model_dir, tmp_path / "run")
    assert not stale.exists() and live.exists() and (tmp_path / "run" / "config.json").is_file()


def test_the_summary_says_the_compute_dtype_beside_the_stored_one(tmp_path, capsys):
    from launch import import_hf

    model_dir = hf_models.synthetic.write_model(tmp_path / "model", hf_models.synthetic.small_config(), dtype=safetensors.DTYPES["BF16"])
    assert import_hf.main([str(model_dir), "--workdir", str(tmp_path / "run"), "--dtype", "float32"]) == 0
    assert "bfloat16 parameters, float32 compute" in capsys.readouterr().out


@pytest.mark.slow
def test_sigterm_during_an_import_exits_3_and_leaves_no_run(tmp_path):
    """A model big enough that writing it takes a while; SIGTERM while Orbax writes its weights
    into the temporary directory (the signal waits for the write, then the import cleans up).
    launch.eval of the workdir then finds no run to advise training."""
    from tests.helpers import ROOT

    config = hf_models.synthetic.small_config(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
    model_dir = hf_models.synthetic.write_model(tmp_path / "model", config)
    run = tmp_path / "run"
    command = [sys.executable, "-m", "launch.import_hf", str(model_dir), "--workdir", str(run)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    while child.poll() is None and not list(tmp_path.glob(f".run{IMPORTING}*/checkpoints/*")):  # Orbax is writing
        time.sleep(0.005)
    child.terminate()
    out, err = child.communicate(timeout=120)
    assert child.returncode == 3, (out, err)
    assert err.strip().splitlines() == [f"stopped by SIGTERM before the import finished: nothing was written to {run}; run the same command to import it"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    evaluation = subprocess.run([sys.executable, "-m", "launch.eval", "--workdir", str(run)], capture_output=True, text=True, cwd=ROOT)
    assert evaluation.returncode == 2 and "train" not in evaluation.stderr, evaluation.stderr
