"""Random Llama-layout model directories, written without torch: for the import tests (bad
input, round trips) and the import memory benchmark (``launch.bench hf_import``).

A directory holds config.json, random tensors in one or more safetensors files (with the index
when sharded) and a small byte-level BPE tokenizer.json (trained with the ``tokenizers`` package
on a few sentences) with <unk>, <s> (BOS) and </s> (EOS), and the tokenizer_config.json saying
the model prepends BOS.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fibjax.hf import safetensors

TOKENIZER_VOCAB = 300
TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Sparse attention reads a window and a few distant keys.",
    "Fibonacci numbers: 1, 2, 3, 5, 8, 13, 21, 34, 55, 89.",
    "A model imported from Hugging Face keeps its tokenizer.",
] * 8
SMALL = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2
)


def write_tokenizer(model_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(Path(model_dir) / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    (Path(model_dir) / "tokenizer_config.json").write_text(json.dumps(config))


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family config.json implies, by its Hugging Face name. Written from
    the config alone, not from the importer's list (``weights.tensors``), because the refusal
    tests need models the importer refuses to describe (an unknown model_type, a sliding window)."""
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    e = hf.get("head_dim") or d // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * e, hf.get("num_key_value_heads", hf["num_attention_heads"]) * e
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not hf.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, d)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        shapes.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.v_proj.weight": (kv, d)})
        shapes.update(
            {p + "self_attn.o_proj.weight": (d, q), p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)}
        )
        if hf["model_type"] == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def write_model(model_dir: Path, hf: dict, *, shards: int = 1, dtype=np.float32, seed: int = 0, std: float = 0.2) -> Path:
    """Write config.json ``hf``, random tensors of ``dtype`` in ``shards`` files (made and written
    one tensor at a time) and a tokenizer into ``model_dir``."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf))
    shapes = tensor_shapes(hf)
    names = sorted(shapes)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k in range(shards):
        group = names[k::shards]
        file = "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        fetch = lambda n: rng.normal(0.0, std, shapes[n]).astype(np.float32).astype(dtype)  # noqa: E731
        safetensors.write(model_dir / file, [(n, np.dtype(dtype), shapes[n], lambda n=n: fetch(n)) for n in group])
        weight_map.update(dict.fromkeys(group, file))
    if shards > 1:
        (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_tokenizer(model_dir)
    return model_dir


def small_config(model_type: str = "llama", tie: bool = False, **changes) -> dict:
    return {"model_type": model_type, **SMALL, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": tie, "hidden_act": "silu", **changes}
